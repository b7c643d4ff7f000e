"""A model's default sampling parameters (vLLM's --generation-config / --override-generation-config): where
they are read from, how overrides merge, and what is refused."""

from __future__ import annotations

import json

import gguf
import pytest

from conveyor.sampling.defaults import DEMO_DEFAULTS, describe, generation_defaults

HF_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "do_sample": True,
             "eos_token_id": 2, "bos_token_id": 1}


def hf_dir(tmp_path, config: dict | None = HF_CONFIG, name: str = "hf-model"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    if config is not None:
        (d / "generation_config.json").write_text(json.dumps(config))
    return d


def gguf_file(tmp_path, sampling: dict) -> object:
    """A GGUF with only metadata: general.sampling.* keys as llama.cpp's converter writes them."""
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(f"general.sampling.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_auto_reads_an_hf_directorys_generation_config(tmp_path):
    values, source = generation_defaults("auto", hf_dir(tmp_path))
    # max_new_tokens is max_tokens; do_sample and the token ids are not sampling defaults (as vLLM)
    assert values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert source.endswith("generation_config.json")
    assert "temperature=0.6, top_p=0.95, top_k=20, max_tokens=64" in describe(values, source)


def test_a_model_without_defaults_and_the_vllm_setting_give_none(tmp_path):
    assert generation_defaults("auto", hf_dir(tmp_path, None)) == ({}, "")
    assert generation_defaults("vllm", hf_dir(tmp_path, HF_CONFIG, "other")) == ({}, "")
    assert "none" in describe({}, "")


def test_auto_reads_a_ggufs_sampling_metadata_and_a_generation_config_beside_it(tmp_path):
    path = gguf_file(tmp_path, {"temp": 0.7, "top_k": 40, "top_p": 0.8, "min_p": 0.05, "penalty_repeat": 1.1})
    values, source = generation_defaults("auto", path)
    assert values == pytest.approx({"temperature": 0.7, "top_k": 40, "top_p": 0.8, "min_p": 0.05,
                                    "repetition_penalty": 1.1})
    assert isinstance(values["top_k"], int) and "general.sampling" in source
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 100}))
    values, source = generation_defaults("auto", path, is_demo=True)   # the file beside wins, key by key
    assert values == pytest.approx({"temperature": 0.3, "top_k": 40, "top_p": 0.8, "min_p": 0.05,
                                    "repetition_penalty": 1.1, "max_tokens": 100})
    assert source.endswith("generation_config.json")


def test_the_demo_model_has_built_in_defaults_unless_it_is_given_some(tmp_path):
    path = gguf_file(tmp_path, {})
    assert generation_defaults("auto", path, is_demo=True) == (DEMO_DEFAULTS, "the demo model's built-in defaults")
    assert generation_defaults("auto", path, is_demo=False) == ({}, "")
    assert generation_defaults("vllm", path, is_demo=True) == ({}, "")
    assert DEMO_DEFAULTS == {"temperature": 0.0}   # greedy: conveyor/sampling/defaults.py says why


def test_a_path_setting_reads_a_folder_or_a_file(tmp_path):
    folder = hf_dir(tmp_path)
    model = gguf_file(tmp_path, {"temp": 0.9})
    assert generation_defaults(str(folder), model)[0]["temperature"] == 0.6
    assert generation_defaults(str(folder / "generation_config.json"), model)[0]["max_tokens"] == 64
    with pytest.raises(ValueError, match="no such file or folder"):
        generation_defaults(str(tmp_path / "missing"), model)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        generation_defaults(str(tmp_path / "list.json"), model)


def test_overrides_merge_over_the_setting_and_are_checked(tmp_path):
    folder = hf_dir(tmp_path)
    values, source = generation_defaults("auto", folder, override='{"temperature": 0.5, "max_new_tokens": 8}')
    assert values == {"temperature": 0.5, "top_p": 0.95, "top_k": 20, "max_tokens": 8}
    assert source.endswith("with overrides")
    assert generation_defaults("vllm", folder, override={"min_p": 0.1}) == ({"min_p": 0.1}, "overrides")
    with pytest.raises(ValueError, match="unknown field.*temprature"):
        generation_defaults("auto", folder, override='{"temprature": 0.5}')
    with pytest.raises(ValueError, match="not JSON"):
        generation_defaults("auto", folder, override="temperature=0.5")
    with pytest.raises(ValueError, match="must be a JSON object"):
        generation_defaults("auto", folder, override="[0.5]")
    with pytest.raises(ValueError, match="temperature must be in"):   # checked as a request's field would be
        generation_defaults("auto", folder, override='{"temperature": -1}')
    bad = hf_dir(tmp_path, {"top_p": 7}, "bad")
    with pytest.raises(ValueError, match="top_p"):
        generation_defaults("auto", bad)
