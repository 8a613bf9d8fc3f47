"""The compact binary plan: the Plan's CSR arrays in one uncompressed ``.npz`` beside a small JSON header.

A 10M-sample plan is ~125 MB of JSON that takes seconds to write and that every rank of a large job parses; the
same plan as raw int arrays is a fraction of that, written at disk speed and opened by memory-mapping (no
parsing: a rank only touches the pages of the steps it runs). JSON (plan.py ``to_json``) stays the form for
small plans and inspection; ``save_plan`` / ``load_plan`` choose by extension (``.npz`` binary, else JSON).

Integer arrays are stored in the fewest bytes a simple layout allows (``_encode``; the header's ``encodings`` names
the members that are not plain numpy arrays): the narrowest of int8/16/32/64; 3 bytes a value (``u24``, a [n, 3]
uint8 member) for sample indices below 2^24; for lengths, whose few long values alone need 17+ bits, the low 16
bits (uint16) plus the rare high parts with their positions (``hi16``); CSR pointers as the sizes they add up
(``sizes``, summed on opening: they are small). A 10M-sample plan is then ~55 MB instead of 88 MB: the sample
indices (~22 bits of information each in a random order) and the lengths (~12 bits each for a long-tailed mix)
leave no simple layout much below that. Nothing is deflated: every member can be memory-mapped at its offset.

Members of the archive (all stored, not deflated, so each can be memory-mapped at its offset in the file):

* ``header``: uint8 UTF-8 JSON: the config (``PlanConfig.to_dict``), version, format, the reasons of dropped
  samples (as a table), deferred samples, metrics, extra keys and the names of the per-step metric arrays;
* ``lengths``, ``pack_ptr``, ``pack_samples``, ``pack_group``, ``step_ptr``, ``step_packs``, ``step_group``,
  ``dropped``, ``dropped_reason_code`` (index into the header's reason table): the Plan's arrays as they are in
  memory (slot-major steps, bytescale's padding packs included), each in the layout above (``hi16`` adds the
  members ``<name>__hi_at`` and ``<name>__hi``);
* ``step_metric_<name>``: one per-step metric array each;
* optional ``pack_row`` (int64 [num_packs]): the packed-shard row of every pack (``data_tools.pack --shards``);
* optional ``optimizer_step`` (int64 [num_steps]): ``Plan.optimizer_step`` of a plan whose optimizer steps span
  several plan steps (hbp step_mix="mixed").
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.common.outputs import atomic_write
from hbp_train.planning.metrics import with_metrics
from hbp_train.planning.plan import PLAN_VERSION, Plan, PlanConfig

FORMAT = "hbp-plan-npz"
ARRAYS = ("lengths", "pack_ptr", "pack_samples", "pack_group", "step_ptr", "step_packs", "step_group", "dropped")


def is_binary_path(path) -> bool:
    """True for a path the binary form is used for (``.npz``)."""
    return str(path).endswith(".npz")


def _narrow(a: np.ndarray, lo: int | None = None, hi: int | None = None) -> np.ndarray:
    """An integer array in the smallest of int8/int16/int32/int64 that holds its values (``lo``/``hi``: its min and
    max when known): the file is then about half of int64's size (read_npz widens the Plan's arrays back to the types
    plan.py documents)."""
    if a.dtype.kind not in "iu" or len(a) == 0:
        return np.ascontiguousarray(a)
    lo, hi = int(a.min()) if lo is None else lo, int(a.max()) if hi is None else hi
    for t in (np.int8, np.int16, np.int32, np.int64):
        if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return np.ascontiguousarray(a, t)
    return np.ascontiguousarray(a)


def _encode(name: str, a: np.ndarray, arrays: dict, encodings: dict, sizes: bool = False) -> None:
    """Put integer array ``a`` into ``arrays`` as member ``name`` in its smallest layout (module docstring);
    ``sizes``: ``a`` is a CSR pointer (0, then non-decreasing), stored as the sizes it adds up."""
    if sizes and len(a) > 1:
        encodings[name] = "sizes"
        a = np.diff(a)
    if a.dtype.kind not in "iu" or len(a) < 1 << 16:  # small arrays: not worth a layout of their own
        arrays[name] = _narrow(a)
        return
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi <= np.iinfo(np.int16).max:
        arrays[name] = _narrow(a, lo, hi)
        return
    high = np.flatnonzero(a > 0xFFFF)
    if len(high) * 6 < len(a) and not sizes:  # 2 bytes a value + ~6 per value of 2^16 and more: below 3 bytes
        encodings[name] = "hi16"
        arrays[name] = np.ascontiguousarray(a, np.uint16)  # the low 16 bits
        arrays[f"{name}__hi_at"], arrays[f"{name}__hi"] = _narrow(high), _narrow(a[high] >> 16)
    elif hi < 1 << 24:
        encodings[name] = encodings.get(name, "") + "u24"
        arrays[name] = np.ascontiguousarray(a.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3])
    else:
        arrays[name] = _narrow(a, lo, hi)


class _DecodedView:
    """A read-only 1-D int64 view over a compact encoding: subclasses set ``_length`` and decode in
    ``__getitem__``; ``np.asarray`` decodes all of it."""

    _length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def shape(self) -> tuple:
        return (self._length,)

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


class Int24Array(_DecodedView):
    """Integers stored in 3 bytes each (a [n, 3] uint8 array, memory-mapped or not): indexing decodes only what it
    reads."""

    def __init__(self, raw: np.ndarray):
        self.raw, self._length = raw, len(raw)

    def __getitem__(self, key):
        b = np.asarray(self.raw[key])
        out = b[..., 0].astype(np.int64) | b[..., 1].astype(np.int64) << 8 | b[..., 2].astype(np.int64) << 16
        return out if out.ndim else int(out)


class High16Array(_DecodedView):
    """Integers stored as their low 16 bits plus the positions and values of the few high parts; decoded on
    access."""

    def __init__(self, low: np.ndarray, at: np.ndarray, high: np.ndarray):
        self.low, self.at, self.high = low, np.asarray(at, np.int64), np.asarray(high, np.int64)
        self._length = len(low)

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self.low))
            out = np.asarray(self.low[start:stop], np.int64)
            lo, hi = np.searchsorted(self.at, [start, stop])
            out[self.at[lo:hi] - start] |= self.high[lo:hi] << 16
            return out
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            return np.asarray(self)[key]
        index = np.where(index < 0, index + len(self.low), index)
        out = np.asarray(self.low[index], np.int64)  # the low bits of just these values; their high parts below
        where = np.minimum(np.searchsorted(self.at, index), max(len(self.at) - 1, 0))
        if len(self.at):
            long = self.at[where] == index
            out[long] |= self.high[where[long]] << 16
        return out if out.ndim else int(out)


def _decode(arrays: dict, encodings: dict) -> None:
    """Replace the encoded members of ``arrays`` (as open_npz read them) by their views or decoded arrays."""
    for name, how in encodings.items():
        if name not in arrays:
            continue
        if how.startswith("sizes"):
            sizes = Int24Array(arrays[name]) if how.endswith("u24") else arrays[name]
            arrays[name] = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))])
        elif how == "u24":
            arrays[name] = Int24Array(arrays[name])
        elif how == "hi16":
            arrays[name] = High16Array(arrays[name], arrays.pop(f"{name}__hi_at"), arrays.pop(f"{name}__hi"))


def write_npz(plan: Plan, path, pack_row: np.ndarray | None = None) -> None:
    """Write ``plan`` as a binary plan to ``path`` (atomically; see the module docstring)."""
    if not plan.metrics:
        with_metrics(plan)
    reasons = sorted(set(plan.dropped_reason))
    code = {r: i for i, r in enumerate(reasons)}
    arrays, encodings = {}, {}
    for name in ARRAYS:
        _encode(name, np.asarray(getattr(plan, name)), arrays, encodings, sizes=name.endswith("_ptr"))
    header = {"format": FORMAT, "version": PLAN_VERSION, **plan.config.to_dict(), "num_samples": plan.num_samples,
              "dropped_reasons": reasons, "deferred": list(plan.deferred), "metrics": plan.metrics,
              "extra": plan.extra, "step_metrics": list(plan.step_metrics), "encodings": encodings}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    arrays["dropped_reason_code"] = np.asarray([code[r] for r in plan.dropped_reason], np.int16)
    for name, values in plan.step_metrics.items():
        arrays[f"step_metric_{name}"] = np.asarray(values)
    if pack_row is not None:
        arrays["pack_row"] = _narrow(np.asarray(pack_row, np.int64))
    if plan.optimizer_step is not None:
        arrays["optimizer_step"] = _narrow(np.asarray(plan.optimizer_step, np.int64))
    Path(path).parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # savez stores (no deflate): every member can be memory-mapped

    atomic_write(path, write)


def open_npz(path, mmap: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, {member: array}) of a binary plan; with ``mmap`` the arrays are read-only memory maps of the file
    (3-byte and split members as Int24Array / High16Array views over them, CSR pointers summed from their sizes).

    UserError (one line, naming the file) for a file that is not a binary plan of this version."""
    path = str(path)
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename[:-4]: i for i in zf.infolist() if i.filename.endswith(".npy")}
            if "header" not in infos:
                raise UserError(f"{path}: not a binary plan (no header member); rewrite it with data_tools.pack")
            arrays = {}
            with open(path, "rb") as raw:
                for name, info in infos.items():
                    if info.compress_type != zipfile.ZIP_STORED or not mmap:
                        with zf.open(info) as f:
                            arrays[name] = np.lib.format.read_array(f)
                        continue
                    # Local file header: 30 bytes + name + extra field, then the .npy bytes (stored as-is).
                    raw.seek(info.header_offset + 26)
                    name_len, extra_len = np.frombuffer(raw.read(4), "<u2").tolist()
                    raw.seek(info.header_offset + 30 + name_len + extra_len)
                    version = np.lib.format.read_magic(raw)
                    if version == (1, 0):
                        shape, fortran, dtype = np.lib.format.read_array_header_1_0(raw)
                    else:
                        shape, fortran, dtype = np.lib.format.read_array_header_2_0(raw)
                    if dtype.hasobject:
                        raise UserError(f"{path}: member {name} holds Python objects; not a binary plan")
                    if int(np.prod(shape)) == 0:
                        arrays[name] = np.zeros(shape, dtype)
                    else:
                        arrays[name] = np.memmap(path, dtype=dtype, mode="r", offset=raw.tell(), shape=shape,
                                                 order="F" if fortran else "C")
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise UserError(f"{path}: cannot read the binary plan ({type(exc).__name__}: {exc}); rewrite it with "
                        "data_tools.pack") from None
    try:
        header = json.loads(bytes(arrays.pop("header")).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: the binary plan's header is not JSON ({exc})") from None
    if header.get("format") != FORMAT or header.get("version") != PLAN_VERSION:
        raise UserError(f"{path}: not a version-{PLAN_VERSION} binary plan (format {header.get('format')!r}, version "
                        f"{header.get('version')!r}); rewrite it with data_tools.pack")
    missing = [a for a in ARRAYS + ("dropped_reason_code",) if a not in arrays]
    if missing:
        raise UserError(f"{path}: binary plan lacks {', '.join(missing)}; rewrite it with data_tools.pack")
    _decode(arrays, header.get("encodings", {}))
    return header, arrays


def read_npz(path, mmap: bool = True) -> Plan:
    """The Plan stored at ``path`` by write_npz (its arrays widened to plan.py's types; the file is memory-mapped
    while reading unless ``mmap`` is False)."""
    header, arrays = open_npz(path, mmap)
    cfg = PlanConfig.from_record(header)
    reasons = header["dropped_reasons"]
    # The Plan's documented types (int64 indices, int32 groups): widened from the file's narrow types in one pass
    # per array (milliseconds at 10M samples). The loader (data.py) reads the memory maps as they are instead.
    typed = {name: np.asarray(arrays[name], np.int32 if name.endswith("group") else np.int64) for name in ARRAYS}
    plan = Plan(config=cfg, **typed,
                optimizer_step=np.asarray(arrays["optimizer_step"], np.int64) if "optimizer_step" in arrays else None,
                dropped_reason=[reasons[c] for c in np.asarray(arrays["dropped_reason_code"]).tolist()],
                deferred=list(header.get("deferred", [])), metrics=dict(header.get("metrics", {})),
                step_metrics={k: arrays[f"step_metric_{k}"] for k in header.get("step_metrics", [])},
                extra=dict(header.get("extra", {})))
    return plan


def check_binary_plan_target(path) -> None:
    """UserError unless ``path`` is new, empty or a binary plan: writing a plan never replaces someone's data."""
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        try:
            open_npz(p, mmap=False)
        except UserError:
            raise UserError(f"--out {path}: exists and is not a binary plan written by hbp-train; choose another "
                            "--out or delete the file") from None


def save_plan(plan: Plan, path, step_rows: list | None = None, pack_row: np.ndarray | None = None) -> None:
    """Write ``plan`` to ``path``: binary for ``.npz`` (with ``pack_row``), JSON otherwise (with ``step_rows``)."""
    if is_binary_path(path):
        write_npz(plan, path, pack_row)
    else:
        plan.to_json(path, step_rows=step_rows)


def load_plan(path, mmap: bool = True) -> Plan:
    """Read a plan written by save_plan: binary for ``.npz``, JSON otherwise."""
    return read_npz(path, mmap) if is_binary_path(path) else with_metrics(Plan.from_json(path))
