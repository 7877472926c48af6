"""`actor_rollout_ref.model.*` and `rollout.dtype`: verl's names, the tiny LM by default, and a bad
model folder refused by `tidal config check` with one line and exit 2."""

from __future__ import annotations

import json

import pytest

from config import ConfigError, load_config
from config.model_keys import HFModelSection
from flows.cli import main


def hf_folder(path, architectures, **extra):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": architectures, **extra}))
    return path


def test_the_default_model_is_the_built_in_tiny_lm_with_verls_defaults():
    cfg = load_config("tiny-cpu")
    assert cfg.actor_rollout_ref.model == HFModelSection(path=None, tokenizer_path=None, custom_chat_template=None,
                                                         trust_remote_code=False, enable_gradient_checkpointing=False)
    assert cfg.actor_rollout_ref.rollout.dtype == "float32"


def test_a_decoder_only_folder_is_accepted_and_the_tokenizer_defaults_to_it(tmp_path):
    folder = hf_folder(tmp_path / "m", ["Qwen2ForCausalLM"], model_type="qwen2")
    cfg = load_config("tiny-cpu", [f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.rollout.dtype=bfloat16",
                                   "actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    model = cfg.actor_rollout_ref.model
    assert (model.path, model.tokenizer_folder, model.enable_gradient_checkpointing) == (str(folder), str(folder), True)
    assert cfg.actor_rollout_ref.rollout.dtype == "bfloat16"


def test_a_separate_tokenizer_folder_is_used_when_given(tmp_path):
    folder = hf_folder(tmp_path / "m", ["LlamaForCausalLM"])
    (tmp_path / "tok").mkdir()
    model = HFModelSection(path=str(folder), tokenizer_path=str(tmp_path / "tok"))
    assert model.tokenizer_folder == str(tmp_path / "tok")


def test_a_tokenizer_path_without_a_model_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer_path is set but path is null"):
        load_config("tiny-cpu", [f"actor_rollout_ref.model.tokenizer_path={tmp_path}"])


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "has no config.json"),
    (lambda p: hf_folder(p / "t5", ["T5ForConditionalGeneration"], is_encoder_decoder=True), "is not a decoder-only causal LM"),
    (lambda p: hf_folder(p / "bert", ["BertModel"], model_type="bert"), "is not a decoder-only causal LM"),
], ids=["missing-folder", "no-config-json", "encoder-decoder", "encoder-only"])
def test_tidal_config_check_refuses_a_bad_model_folder_with_one_line_and_exit_2(tmp_path, capsys, make, expected):
    folder = make(tmp_path)
    code = main(["config", "check", "tiny-cpu", "--set", f"actor_rollout_ref.model.path={folder}"])
    out, err = capsys.readouterr()
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert err.startswith("tidal: error: actor_rollout_ref.model.path: ") and expected in err


def test_an_unknown_rollout_dtype_is_refused():
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.dtype"):
        load_config("tiny-cpu", ["actor_rollout_ref.rollout.dtype=int4"])
