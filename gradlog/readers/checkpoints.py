"""Reading checkpoints tensor by tensor, for `gradlog diff`: nothing is read until a tensor is touched.

Formats:
- `torch.save` files (a state dict, or a full checkpoint holding one under `state_dict`, `model`,
  `model_state_dict`, `module`, ...), loaded with ``weights_only=True`` (no code runs) and
  ``mmap=True`` (tensors stay in the file until read; files from before torch's zip format are read
  whole, as torch cannot map them);
- `.safetensors` files, through the `safetensors` package's `safe_open` (memory-mapped too);
- Hugging Face model folders: ``model.safetensors``, ``pytorch_model.bin`` and their sharded forms
  (``*.index.json`` maps each tensor to its shard), with the Trainer's ``optimizer.pt`` when present.

Files are checked before they are opened: regular files only (a FIFO would block, a device never
ends), non-empty, a recognised header, and shard names that stay inside their folder.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gradlog.measure.params import clean_name

#: a safetensors header or an index file larger than this is not a model's: refuse it rather than parse it
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: keys under which full checkpoints keep the model's state dict, most specific first
STATE_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "network", "model_state", "weights")
#: keys under which full checkpoints keep the optimizer's state dict (Lightning: a list of them)
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state", "optim", "optimizer_states")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"), ("U32", "uint32")):
    if hasattr(torch, _attr):
        _SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)
_SAFETENSORS_DTYPES.update({"U64": torch.uint64} if hasattr(torch, "uint64") else {})


class BadCheckpoint(Exception):
    """The input is not a checkpoint gradlog can read: the message names the path and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)

    def text(self) -> str:
        return f"{'x'.join(map(str, self.shape)) or 'scalar'} {str(self.dtype).replace('torch.', '')}"


def _itemsize(dtype: torch.dtype) -> int:
    size: int = dtype.itemsize
    return size


def regular_file(path: str, what: str = "checkpoint") -> int:
    """The file's size, after checking it is a regular, non-empty, readable file (symlinks followed)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise BadCheckpoint(f"cannot read {what} {path!r}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) else "not a file"
        raise BadCheckpoint(f"{what} {path!r} is {kind}: pass a regular file or a model folder")
    if st.st_size == 0:
        raise BadCheckpoint(f"{what} {path!r} is empty (0 bytes): was it still being written?")
    if not os.access(path, os.R_OK):
        raise BadCheckpoint(f"cannot read {what} {path!r}: permission denied")
    return int(st.st_size)


def _head(path: str, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as exc:
        raise BadCheckpoint(f"cannot read {path!r}: {exc.strerror or exc}") from exc


class _Shard:
    """One file of a checkpoint: tensor names, their shapes and dtypes, and the tensors on demand."""

    names: list[str]

    def info(self, name: str) -> TensorInfo:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError


class _SafetensorsShard(_Shard):
    def __init__(self, path: str) -> None:
        size = regular_file(path)
        head = _head(path, 8)
        (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if len(head) < 8 or header_len + 8 > size or header_len > MAX_HEADER_BYTES:
            raise BadCheckpoint(
                f"{path!r} is not a .safetensors file (its header says {header_len} bytes, the file has {size})"
            )
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise BadCheckpoint(
                "reading .safetensors files needs the safetensors package: pip install 'gradlog[diff]'"
            ) from exc
        try:
            opener: Any = safe_open  # the package ships no type hints
            self._file: Any = opener(path, framework="pt", device="cpu")
            self.names = list(self._file.keys())
            self._infos = {}
            for name in self.names:
                sl = self._file.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise BadCheckpoint(
                        f"{path!r}: tensor {name!r} has dtype {sl.get_dtype()}, which torch cannot hold"
                    )
                self._infos[name] = TensorInfo(tuple(int(s) for s in sl.get_shape()), dtype)
        except BadCheckpoint:
            raise
        except Exception as exc:
            raise BadCheckpoint(f"cannot read {path!r} as .safetensors ({type(exc).__name__}: {exc})") from exc

    def info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def get(self, name: str) -> torch.Tensor:
        t: torch.Tensor = self._file.get_tensor(name)
        return t


def _torch_load(path: str) -> Any:
    """`torch.load` with no code execution, memory-mapped when the file format allows."""
    regular_file(path)
    head = _head(path, 4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise BadCheckpoint(f"{path!r} is not a torch.save file, a .safetensors file or a model folder")
    mmap = head.startswith(b"PK")  # torch's zip format; older files cannot be mapped
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise BadCheckpoint(
            f"cannot load {path!r} with torch.load(weights_only=True) ({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc


def _is_state_dict(obj: Any) -> bool:
    if not isinstance(obj, Mapping) or not obj:
        return False
    tensors = sum(isinstance(v, torch.Tensor) for v in obj.values())
    return tensors > 0 and tensors * 2 >= len(obj) and all(isinstance(k, str) for k in obj)


def find_state_dict(obj: Any, path: str, depth: int = 0) -> dict[str, torch.Tensor]:
    """The model's tensors in a state dict or a full checkpoint (searched a few levels deep)."""
    if _is_state_dict(obj):
        return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if isinstance(obj, Mapping) and depth < 3:
        for key in STATE_KEYS:
            if key in obj:
                try:
                    return find_state_dict(obj[key], path, depth + 1)
                except BadCheckpoint:
                    continue
    if depth:
        raise BadCheckpoint(f"{path!r}: no state dict here")
    keys = list(obj)[:12] if isinstance(obj, Mapping) else []
    raise BadCheckpoint(
        f"{path!r} holds no model state dict (a {type(obj).__name__}"
        + (f" with keys {keys}" if keys else "")
        + f"); gradlog looks for a dict of tensors, or one under {', '.join(repr(k) for k in STATE_KEYS[:4])}, ..."
    )


def find_optimizer_state(obj: Any) -> dict[str, Any] | None:
    """An optimizer's `state_dict()` in a full checkpoint, if it holds one (Lightning's list: the first)."""
    if not isinstance(obj, Mapping):
        return None
    for key in OPTIMIZER_KEYS:
        opt = obj.get(key)
        if isinstance(opt, (list, tuple)) and opt:
            opt = opt[0]
        if (
            isinstance(opt, Mapping)
            and isinstance(opt.get("state"), Mapping)
            and isinstance(opt.get("param_groups"), (list, tuple))
        ):
            return dict(opt)
    return None


class _TorchShard(_Shard):
    def __init__(self, path: str, loaded: Any = None) -> None:
        obj = _torch_load(path) if loaded is None else loaded
        self.tensors = find_state_dict(obj, path)
        self.optimizer = find_optimizer_state(obj)
        self.names = list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        t = self.tensors[name]
        return TensorInfo(tuple(t.shape), t.dtype)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _inside(folder: str, name: Any, index: str) -> str:
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise BadCheckpoint(f"{index!r} names shard {name!r}, which is not a file inside {folder!r}")
    return os.path.join(folder, name)


def _read_index(path: str) -> dict[str, str]:
    size = regular_file(path, "index file")
    if size > MAX_HEADER_BYTES:
        raise BadCheckpoint(f"index file {path!r} is {size} bytes: too large for a weight map")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise BadCheckpoint(f"cannot read index file {path!r} ({type(exc).__name__}: {exc})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadCheckpoint(f"index file {path!r} has no 'weight_map' of tensor names to shard files")
    return {str(k): _inside(os.path.dirname(path), v, path) for k, v in weight_map.items()}


class Checkpoint:
    """One checkpoint: its tensors (clean names, file order), read one at a time on demand."""

    def __init__(self, path: str, label: str | None = None) -> None:
        self.path = path
        self.label = label or os.path.basename(os.path.normpath(path)) or path
        self.optimizer: dict[str, Any] | None = None
        self._where: dict[str, tuple[_Shard | str, str]] = {}  # clean name -> (shard or its path, raw name)
        self._open: dict[str, _Shard] = {}
        if os.path.isdir(path):
            self.kind = self._folder(path)
        else:
            self.kind = self._file(path)
        if not self._where:
            raise BadCheckpoint(f"{path!r} holds no tensors")

    # -- building -------------------------------------------------------------------------------
    def _add(self, raw_names: list[str], shard: _Shard | str) -> None:
        cleaned = [clean_name(n) for n in raw_names]
        # wrapper prefixes (DDP's module., compile's _orig_mod.) are dropped, unless that makes two names one
        use = cleaned if len(set(cleaned)) == len(cleaned) else raw_names
        for name, raw in zip(use, raw_names):
            self._where[name] = (shard, raw)

    def _file(self, path: str) -> str:
        if path.endswith(".safetensors"):
            first = _SafetensorsShard(path)
            self._add(first.names, self._remember(path, first))
            return "safetensors"
        head = _head(path, 8) if os.path.isfile(path) else b""
        if len(head) == 8 and not head.startswith(b"PK") and head[:1] != b"\x80":
            (n,) = struct.unpack("<Q", head)
            if 0 < n <= MAX_HEADER_BYTES and _head(path, 9)[8:9] == b"{":  # a safetensors file by another name
                shard: _Shard = _SafetensorsShard(path)
                self._add(shard.names, self._remember(path, shard))
                return "safetensors"
        torch_shard = _TorchShard(path)
        self.optimizer = torch_shard.optimizer
        self._add(torch_shard.names, self._remember(path, torch_shard))
        return "torch"

    def _remember(self, path: str, shard: _Shard) -> _Shard:
        self._open[path] = shard
        return shard

    def _folder(self, folder: str) -> str:
        def at(name: str) -> str:
            return os.path.join(folder, name)

        kind = ""
        for index, fmt in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "torch")):
            if os.path.exists(at(index)):
                weight_map = _read_index(at(index))
                by_shard: dict[str, list[str]] = {}
                for name, shard_path in weight_map.items():
                    by_shard.setdefault(shard_path, []).append(name)
                for shard_path in by_shard:
                    regular_file(shard_path, "shard")
                for shard_path, names in by_shard.items():
                    self._add(names, shard_path)  # opened on first use
                self._formats = {p: fmt for p in by_shard}
                kind = f"{fmt} folder, {len(by_shard)} shard{'s' if len(by_shard) != 1 else ''}"
                break
        else:
            for single, fmt in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "torch")):
                if os.path.exists(at(single)):
                    shard = _SafetensorsShard(at(single)) if fmt == "safetensors" else _TorchShard(at(single))
                    self._add(shard.names, self._remember(at(single), shard))
                    kind = f"{fmt} folder"
                    break
        if not kind:
            raise BadCheckpoint(
                f"folder {folder!r} holds no model.safetensors, pytorch_model.bin or *.index.json: pass a Hugging "
                "Face model folder, or the checkpoint files themselves"
            )
        if os.path.exists(at("optimizer.pt")):  # a Trainer checkpoint folder
            try:
                self.optimizer = find_optimizer_state({"optimizer": _torch_load(at("optimizer.pt"))})
            except BadCheckpoint:
                self.optimizer = None
        return kind

    # -- reading --------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _shard(self, name: str) -> tuple[_Shard, str]:
        shard, raw = self._where[name]
        if isinstance(shard, str):
            opened = self._open.get(shard)
            if opened is None:
                fmt = getattr(self, "_formats", {}).get(shard, "torch")
                opened = _SafetensorsShard(shard) if fmt == "safetensors" else _TorchShard(shard)
                missing = [n for n, (s, r) in self._where.items() if s == shard and r not in opened.names]
                if missing:
                    raise BadCheckpoint(f"shard {shard!r} lacks {missing[0]!r}, which its index names")
                self._open[shard] = opened
            return opened, raw
        return shard, raw

    def info(self, name: str) -> TensorInfo:
        shard, raw = self._shard(name)
        return shard.info(raw)

    def get(self, name: str) -> torch.Tensor:
        """The tensor on the CPU; memory-mapped formats read it from the file now."""
        shard, raw = self._shard(name)
        try:
            return shard.get(raw)
        except Exception as exc:
            raise BadCheckpoint(
                f"cannot read tensor {name!r} from {self.path!r} ({type(exc).__name__}: {exc})"
            ) from exc
