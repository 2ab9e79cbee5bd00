"""Files of a Hugging Face model directory: safetensors (lazy reads, sharded writes), config.json,
tokenizer files, and output directories that appear whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from jaxtrain.storage import object_store, small_files
from jaxtrain.storage.paths import is_remote, join
from jaxtrain.config import ConfigError, ModelConfig
from jaxtrain.hf.mapping import hf_shapes

HF_CONFIG = "hf_config.json"  # the source's config.json, kept beside an import
# Tokenizer (and generation) files copied through on import and export when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
DTYPES = {"fp32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}
SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}

# ----------------------------------------------------------------------------- safetensors files


class SafetensorsReader:
    """Lazy access to the tensors of a directory of safetensors files (one file or an index)."""

    def __init__(self, src: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open  # import here: only import/export need it

        index = src / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in src.glob("*.safetensors"))
        if not files:
            hint = " (PyTorch .bin files are pickles and are not read; save with safetensors)" if any(
                src.glob("*.bin")) else ""
            raise ConfigError(f"'{src}' holds no *.safetensors weights{hint}")
        self.files = files
        self.location: dict[str, Any] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        self._data: dict[str, tuple[str, int]] = {}  # name -> (file, byte offset of its data)
        for name in files:
            path = src / name
            if not path.is_file():
                raise ConfigError(f"'{path}' is named in the safetensors index but does not exist")
            try:
                handle = stack.enter_context(safe_open(os.fspath(path), framework="numpy"))
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise ConfigError(f"'{path}' is not a readable safetensors file ({type(e).__name__}: {e})") from None
            for key in handle.keys():
                sl = handle.get_slice(key)
                self.location[key] = handle
                self.shape[key] = tuple(sl.get_shape())
                self.dtype[key] = sl.get_dtype()
            self._data.update(_data_offsets(path))

    def get(self, name: str) -> np.ndarray:
        return self.location[name].get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `name` (a F32, BF16 or F16 one), read with ordinary file reads.

        `get` reads through safetensors' memory map, whose pages stay resident (and count in the
        process's RSS) until the file is closed; a streaming import reads here instead, so its
        memory holds only the rows asked for.
        """
        path, offset = self._data[name]
        dtype = np.dtype(DTYPES[SAFETENSORS_DTYPES[self.dtype[name]]])  # little-endian, as every host we run on
        row = int(np.prod(self.shape[name][1:], dtype=np.int64))
        out = np.fromfile(path, dtype=dtype, count=(stop - start) * row, offset=offset + start * row * dtype.itemsize)
        return out.reshape((stop - start, *self.shape[name][1:]))


def _data_offsets(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (file, byte offset of its data) from a safetensors header: an 8-byte little-endian
    header length, the JSON header (`data_offsets` relative to its end), then the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: (os.fspath(path), 8 + size + v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}


def check_tensors(reader: SafetensorsReader, m: ModelConfig) -> str:
    """Raise ConfigError unless the files hold exactly the tensors of this model; returns the
    source dtype ('fp32', 'bf16', 'fp16' or 'mixed')."""
    expected = hf_shapes(m)
    # Buffers that old checkpoints saved and that carry no information we need.
    ignorable = re.compile(r"(.*\.rotary_emb\.inv_freq|lm_head\.weight)$")
    for name, shape in expected.items():
        if name not in reader.shape:
            raise ConfigError(f"tensor '{name}' is missing from the safetensors files")
        if reader.shape[name] != shape:
            raise ConfigError(f"tensor '{name}' has shape {list(reader.shape[name])}; config.json implies {list(shape)}")
    extra = sorted(n for n in reader.shape if n not in expected and not ignorable.match(n))
    if extra:
        raise ConfigError(f"tensor '{extra[0]}' has no place in jaxtrain's model"
                          f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")
    kinds = set()
    for name in expected:
        kind = SAFETENSORS_DTYPES.get(reader.dtype[name])
        if kind is None:
            raise ConfigError(f"tensor '{name}' has dtype {reader.dtype[name]}; only F32, BF16 and F16 can be imported")
        kinds.add(kind)
    return kinds.pop() if len(kinds) == 1 else "mixed"


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units, as transformers' max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError(f"--max-shard-size '{text}' is not a size like 5GB, 500MB or 1000000")
    unit = (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    value = int(float(match.group(1)) * scale)
    if value <= 0:
        raise ConfigError(f"--max-shard-size '{text}' must be positive")
    return value


def write_safetensors(tensors: list[tuple[str, np.ndarray]], dst: Path, max_shard_bytes: int) -> list[str]:
    """Write `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when the total exceeds `max_shard_bytes`. Returns file names."""
    from safetensors.numpy import save_file

    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for name, t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:  # a tensor over the limit gets a shard alone
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += t.nbytes
    meta = {"format": "pt"}  # transformers refuses safetensors files without a known format
    if len(shards) == 1:
        save_file(dict(shards[0]), os.fspath(dst / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(dict(shard), os.fspath(dst / file), metadata=meta)
        names.append(file)
        weight_map.update({name: file for name, _ in shard})
    total = sum(t.nbytes for _, t in tensors)
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]


# ----------------------------------------------------------------------------- directories


def refuse_url(path: str, what: str, hint: str) -> None:
    """Raise ConfigError when `path` is a URL: `what` (an option or argument) takes a local path.

    Hugging Face directories are read and written on local disk (safetensors files are opened
    memory-mapped, outputs appear by one rename); without this check a URL would be taken for a
    relative path and fail as "does not exist", or write a local folder named 'gs:' / 's3:'.
    `hint` says what to do instead.
    """
    if is_remote(path):
        raise ConfigError(f"{what} '{path}' is a URL; it must be a local directory ({hint})")


def fresh_output(path: str) -> tuple[Path, Path]:
    """(final, temporary) paths for an output directory that must not exist or be empty.

    Everything is written into the temporary sibling and renamed at the end, so a failure
    leaves no half-written output behind and existing files are never touched.
    """
    out = Path(path).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output '{path}' already exists and is not an empty directory; choose a new one")
    ancestor = out.parent  # missing parents are made when writing starts (like mkdir -p)
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"output '{path}' cannot be made: '{ancestor}' is a file")
    return out, out.parent / f".{out.name}.partial-{os.getpid()}"


def finish(tmp: Path, out: Path) -> None:
    """Move the finished temporary directory to its final name, its files readable as any new
    file of this process (0644 under umask 022)."""
    _ordinary_modes(tmp)
    if out.exists():
        out.rmdir()  # checked empty above; rename needs it gone (or empty) on every platform
    os.replace(tmp, out)


def _ordinary_modes(folder: Path) -> None:
    """Give every file under `folder` the mode a new file gets here (0666 less the umask).

    safetensors writes its files 0600, unreadable to the group that serves or reads the model.
    The umask is read from a probe file rather than os.umask(), which would change it process-wide
    for a moment.
    """
    probe = folder / ".mode-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


@contextlib.contextmanager
def writing(tmp: Path) -> Iterator[Path]:
    """Create `tmp` (and missing parents); remove it again if the body fails."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        _remove_settled(tmp)
        raise


def _remove_settled(folder: Path, settle_s: float = 0.3, timeout_s: float = 10.0) -> None:
    """Remove `folder` until it stays gone for `settle_s`: after an interrupt (Ctrl-C) in the middle
    of a checkpoint write, tensorstore's own threads finish the writes they had begun and recreate
    the folders they write into (seen: the import's temporary folder left behind)."""
    deadline = time.monotonic() + timeout_s
    while True:
        shutil.rmtree(folder, ignore_errors=True)
        time.sleep(settle_s)
        if not folder.exists() or time.monotonic() > deadline:
            return


def copy_tokenizer(src: str | Path, dst: Path) -> list[str]:
    """Copy the tokenizer (and generation) files present in `src` (a local folder or a gs:// /
    s3:// URL) into the local folder `dst`; returns the names copied."""
    src = os.fspath(src)
    if is_remote(src):
        fs = object_store.filesystem(src)
        fs.invalidate_cache()
        # One listing rather than a lookup per candidate name.
        present = {posixpath.basename(p.rstrip("/")) for p in fs.ls(src, detail=False)}
    else:
        present = {name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(src, name))}
    copied = []
    for name in TOKENIZER_FILES:
        if name in present:
            (dst / name).write_bytes(small_files.read_bytes(join(src, name)))
            copied.append(name)
    return copied


def write_tokenizer(tokenizer_file: Path, eod_id: int, dst: Path, max_len: int) -> list[str]:
    """Write a bare `tokenizers` JSON file (as `prepare-data --tokenizer` takes) as a Hugging Face
    tokenizer: `tokenizer.json` plus a `tokenizer_config.json` naming the end-of-document token as
    bos, eos and pad (jaxtrain ends every document with it, so it also starts the next one).

    An eod id one past the vocabulary (a tokenizer without an end-of-text token, see
    `jaxtrain.data.tokenizer`) is added as the special token `<|endoftext|>`, so the exported
    tokenizer can name it. Returns the names written.
    """
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.fspath(tokenizer_file))
    token = tok.id_to_token(eod_id)
    if token is None and eod_id == tok.get_vocab_size(with_added_tokens=True):
        tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
        token = tok.id_to_token(eod_id)
        tok.save(os.fspath(dst / "tokenizer.json"))
    else:
        shutil.copyfile(tokenizer_file, dst / "tokenizer.json")  # the exact file the data was made with
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                              "clean_up_tokenization_spaces": False}
    if token is not None:  # an id the tokenizer cannot name still goes into config.json
        config.update(bos_token=token, eos_token=token, pad_token=token)
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def write_generation_config(ids: dict[str, int], dst: Path) -> str:
    """Write `generation_config.json` with the bos/eos/pad ids, so `generate` stops at eos."""
    (dst / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return "generation_config.json"


def read_hf_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise ConfigError(f"'{src}' has no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"'{path}' is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"'{path}' must hold a JSON object")
    return hf
