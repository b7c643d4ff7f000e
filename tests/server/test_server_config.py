"""`conveyor serve`'s server flags are generated from one declaration (conveyor/server/config.py):
every field is a flag with its default and help, the flags parse back into the same config, and a
bad value is refused with its name, from the command line and from code alike."""

from __future__ import annotations

from dataclasses import fields

import pytest

from conveyor.cli import build_parser
from conveyor.server.config import ServerConfig, server_config_from_args


def _serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def _server_flags() -> dict[str, object]:
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values()
                 if a.prog.endswith(" serve"))
    group = next(g for g in serve._action_groups if g.title == "server")
    return {a.dest: a for a in group._group_actions}


def test_every_field_is_a_flag_with_its_default_and_help(monkeypatch):
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    flags = _server_flags()
    assert set(flags) == {f.name for f in fields(ServerConfig)}
    for f in fields(ServerConfig):
        assert flags[f.name].default == f.default and flags[f.name].help == f.metadata["help"], f.name
        assert flags[f.name].option_strings[0] == "--" + f.name.replace("_", "-")
    assert server_config_from_args(_serve()) == ServerConfig()


def test_flags_parse_into_the_config():
    args = _serve("--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--served-model-name", "a", "b",
                  "--max-waiting", "0", "--log-interval", "2.5", "--no-engine-process", "--log-requests",
                  "--allowed-origins", "*", "--reasoning-parser", "qwen3", "--tool-call-parser", "json",
                  "--router", "least-load", "--data-parallel-size", "2", "--access-log",
                  "--request-log-file", "/tmp/req.log", "--max-num-seqs", "3")
    server = server_config_from_args(args)
    assert server == ServerConfig(host="0.0.0.0", port=9001, api_key="k", served_model_name=["a", "b"],
                                  max_waiting=0, log_interval=2.5, engine_process=False, log_requests=True,
                                  allowed_origins=["*"], reasoning_parser="qwen3", tool_call_parser="json",
                                  router="least-load", data_parallel_size=2, access_log=True,
                                  request_log_file="/tmp/req.log")
    assert args.max_num_seqs == 3   # the engine's flags sit beside them, from EngineConfig
    assert ServerConfig(request_log_file="x").logs_requests and not ServerConfig().logs_requests


def test_the_api_key_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    assert server_config_from_args(_serve()).api_key == "from-env"
    assert server_config_from_args(_serve("--api-key", "flag")).api_key == "flag"
    monkeypatch.setenv("CONVEYOR_API_KEY", "")   # set but empty: an open server, as when unset
    assert server_config_from_args(_serve()).api_key is None


@pytest.mark.parametrize("argv, message", [
    (("--port", "70000"), "port must be in"),
    (("--max-waiting", "-1"), "max_waiting must be a number >= 0"),
    (("--shutdown-timeout", "-5"), "shutdown_timeout must be"),
    (("--max-body-bytes", "0"), "max_body_bytes must be a number >= 1"),
    (("--data-parallel-size", "0"), "data_parallel_size must be"),
    (("--api-key", ""), "api_key must not be empty"),
])
def test_a_bad_value_is_refused_with_its_name(argv, message):
    with pytest.raises(SystemExit, match=message):
        server_config_from_args(_serve(*argv))


def test_choices_are_checked_by_the_parser_and_by_the_config(capsys):
    with pytest.raises(SystemExit):
        _serve("--reasoning-parser", "nope")
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    for bad in ({"router": "random"}, {"log_level": "loud"}, {"tool_call_parser": "xml"},
                {"reasoning_parser": "nope"}, {"served_model_name": "one"}, {"allowed_origins": []}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerConfig(**bad)
