"""Every JSON the tools read goes through mha_spec.files: bytes that are not UTF-8, nesting deeper
than Python's reader recurses, and integers too long to convert are one error naming the file
(a usage error for config.json and the safetensors index, a warning for the kernel table)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from mha_jax import kernels
from mha_spec.files import JSONFileError, parse_json, read_json
from parity import layouts

DEEP = b"[" * 200_000 + b"]" * 200_000  # RecursionError inside json.loads
NOT_UTF8 = b'{"schema": "\xff\xfe"}'
HUGE_INT = b'{"n": ' + b"9" * 5000 + b"}"  # more digits than int() converts by default


@pytest.mark.parametrize("data, message", [
    (DEEP, "JSON nested too deeply"),
    (NOT_UTF8, "not UTF-8 text"),
    (HUGE_INT, "not readable JSON"),
    (b"{truncated", "not valid JSON"),
])
def test_the_reader_turns_every_decode_failure_into_one_error_naming_the_file(tmp_path, data, message):
    path = tmp_path / "x.json"
    path.write_bytes(data)
    with pytest.raises(JSONFileError, match=f"^{path}: {message}") as info:
        read_json(path)
    assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")
    assert parse_json(b'{"a": [1, 2.5]}', "text") == {"a": [1, 2.5]}


@pytest.mark.parametrize("data", [DEEP, NOT_UTF8, HUGE_INT])
def test_a_kernel_table_that_cannot_be_decoded_is_ignored_with_a_warning(tmp_path, monkeypatch, data):
    path = tmp_path / "kernels.json"
    path.write_bytes(data)
    with pytest.warns(UserWarning, match=f"kernel table {path} is ignored"):
        assert kernels.load_user_table(path) == {}


@pytest.mark.parametrize("data", [DEEP, NOT_UTF8, HUGE_INT])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_config_and_index_that_cannot_be_decoded_are_value_errors_naming_the_file(tmp_path, data, name):
    if name == "config.json":
        (tmp_path / name).write_bytes(data)
    else:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 12,
                                                          "num_attention_heads": 3}))
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=f"{tmp_path / name}: ") as info:
        layouts.read_checkpoint(tmp_path, "hf-llama", prefix="")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data", [DEEP, NOT_UTF8])
def test_the_checkpoint_cli_names_an_undecodable_config_with_exit_2(tmp_path, capsys, data):
    from parity.cli import main

    (tmp_path / "config.json").write_bytes(data)
    assert main(["--no-progress", "--checkpoint", str(tmp_path), "--impls", "torch", "--checks", "forward",
                 "--dtypes", "float32"]) == 2
    out = capsys.readouterr().err  # a checkpoint refusal goes to stderr
    assert "config.json" in out and "Traceback" not in out


def test_a_corrupt_table_leaves_the_fused_call_working(tmp_path, monkeypatch):
    monkeypatch.setenv("MHA_PARITY_CACHE_DIR", str(tmp_path))
    (tmp_path / "kernels.json").write_bytes(DEEP)
    with pytest.warns(UserWarning, match="is ignored"):
        c = kernels.fused_choice(4, 8, 64, 64, 64, jnp.float32, has_mask=False)
    assert c.kernel in kernels.KERNELS and not c.why.startswith("user table")
