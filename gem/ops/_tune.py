"""The launch-config tuner of every Triton op: host side, since a grid may depend on the config (tile height ->
work table), and a launch after the first costs a dictionary lookup.

Picks are reproducible: each candidate is timed over several runs (the median kept), and a later candidate replaces
an earlier one only when faster by more than MARGIN, so near-ties resolve the same way in every process. Tuned picks
are kept on disk (plain JSON, one file per op and environment; docs/TUNING.md), so a later process reuses them
instead of timing again; package-shipped picks (gem/ops/tuned/defaults.json) are consulted after that cache.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from gem.ops._common import triton_interpreting

REPS = 5  # timed runs per candidate, at least
MARGIN = 0.03  # a later candidate must be this much faster than an earlier one to be picked over it
FORMAT = 1  # the cache files' layout version
SHIPPED = Path(__file__).parent / "tuned" / "defaults.json"


class LaunchConfig(NamedTuple):
    """One launch of a Triton kernel as a tuner picks it: tile sizes and other launch-time choices by name (BLOCK_M,
    BLOCK_N, ..., or an op's own, e.g. rope's layout) and the compiler's options. The config type of every gem.ops
    tuner; its JSON form (tuning caches, gem/ops/tuned/defaults.json) is the dict of its fields by name."""

    tiles: tuple = ()  # ((name, value), ...)
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default
    maxnreg: int | None = None  # ptxas's per-thread register cap, so that more programs share an SM (GPU only)

    @classmethod
    def of(cls, num_warps: int, num_stages: int | None = None, maxnreg: int | None = None, **tiles) -> LaunchConfig:
        return cls(tuple(tiles.items()), num_warps, num_stages, maxnreg)

    def tile(self, name: str, default=None):
        for k, v in self.tiles:
            if k == name:
                return v
        return default

    @property
    def block_m(self):
        return self.tile("BLOCK_M")

    @property
    def block_n(self):
        return self.tile("BLOCK_N")

    def launch_kwargs(self) -> dict:
        """The kernel launch's keywords: the tiles as constexprs and the compiler options that are set (maxnreg not
        under the interpreter, which has no registers)."""
        kw = dict(self.tiles)
        kw["num_warps"] = self.num_warps
        if self.num_stages is not None:
            kw["num_stages"] = self.num_stages
        if self.maxnreg is not None and not triton_interpreting():
            kw["maxnreg"] = self.maxnreg
        return kw

    def json(self) -> dict:
        out = {**dict(self.tiles), "num_warps": self.num_warps}
        for k in ("num_stages", "maxnreg"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    def __str__(self) -> str:  # as GEM_TUNE_LOG=1 prints it
        return " ".join([f"{k}={v}" for k, v in self.tiles] + [f"w{self.num_warps}"]
                        + ([f"s{self.num_stages}"] if self.num_stages is not None else [])
                        + ([f"r{self.maxnreg}"] if self.maxnreg is not None else []))


def tile_config(block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None = None
                ) -> LaunchConfig:
    """The LaunchConfig of an attention pass's (BLOCK_M, BLOCK_N) tile."""
    return LaunchConfig.of(num_warps, num_stages, maxnreg, BLOCK_M=block_m, BLOCK_N=block_n)


class ConfigTuner:
    """Best config per (kind, key): from memory, else the user's cache dir, else the shipped defaults, else timed
    on the first call with that key (and then written to the cache dir).

    `launch(cfg)` must be idempotent (the kernels only store), since timing runs it repeatedly. With GEM_AUTOTUNE=0
    (the `env` variable) the first candidate that compiles and launches is kept without timing or cache (fp32 tiles
    can exceed shared memory). gem's ops give LaunchConfigs; tuples, dicts of JSON scalars and triton.Config-like
    objects work too. A cached config is used only when it equals one of the current candidates.
    """

    def __init__(self, name: str, env: str = "GEM_AUTOTUNE"):
        self.name, self.env = name, env
        self.best: dict = {}
        self._stored: dict | None = None  # key string -> JSON config, from the cache file and the shipped defaults

    def bench(self, fn: Callable[[], None]) -> float:
        """Median milliseconds per call over >= REPS timed runs: triton's do_bench on the GPU (L2 flushed between
        runs), wall clock elsewhere (CPU tests)."""
        if torch.cuda.is_available() and not triton_interpreting():
            from triton.testing import do_bench

            times: list[float] = []
            while len(times) < REPS:  # do_bench times as many runs as fit in `rep` ms: one, for a slow kernel
                times += do_bench(fn, warmup=5, rep=20, return_mode="all")
            return statistics.median(times)
        fn()  # warm-up (compiles)
        times = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def pick(self, kind: str, key: tuple, cands: list | Callable[[], list], launch: Callable, device: torch.device,
             outputs: tuple[torch.Tensor, ...] = (), *, estimate: Callable | None = None, fallback: list = ()):
        """The config to launch; `cands` (or a function making them, called only when the key is new) in order.
        `outputs`: tensors every launch writes whole and none reads. While timing they are NaN-filled before each
        candidate, then compared with the other candidates' (agreeing_configs): a config whose result disagrees is
        not picked.

        `estimate(cfg)`: a config's shared memory in bytes (e.g. attention_smem); candidates over this device's
        limit are dropped before any launch, and where none is left, or none launches, the `fallback` configs
        (smaller tiles, in order) are tried untimed: the first that launches is kept. Both are read only for a new
        key, so a caller passes a lambda rather than building an estimate on every call."""
        full_key = (kind,) + key
        best = self.best.get(full_key)
        if best is not None:
            return best
        if callable(cands):
            cands = cands()
        if estimate is not None:
            cands, fallback = fitting(cands, fallback, estimate, shared_memory_limit(device))
        if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return (list(cands) + list(fallback))[0]  # no timing (syncs) while tracing or capturing a graph
        if not cands:  # none estimated to fit: the smaller tiles, untimed
            return self._first_launching(full_key, list(fallback), launch)
        if len(cands) == 1 or os.environ.get(self.env, "1") == "0":
            return self._first_launching(full_key, list(cands) + list(fallback), launch)
        skey = _key_string(kind, key)
        if skey is not None:
            cfg = self._from_disk(skey, cands, device)
            if cfg is not None:
                self.best[full_key] = cfg
                return cfg
        times, prints = [], []
        for cfg in cands:
            for t in outputs:
                if t.is_floating_point():
                    t.fill_(float("nan"))  # a config that skips a store then shows, instead of the last one's values
            try:
                times.append((self.bench(lambda cfg=cfg: launch(cfg)), cfg))
            except Exception as e:  # e.g. out of shared memory or registers for this tile shape
                if not _config_error(e):
                    raise
                print(f"{self.name}: config {cfg} for {kind} unusable: {type(e).__name__}")
                continue
            prints.append(fingerprint(outputs))
        if not times:
            if fallback:  # nothing launched: smaller tiles, untimed
                return self._first_launching(full_key, list(fallback), launch)
            raise RuntimeError(f"{self.name}: no {kind} config in {cands} launches for {key}")
        if outputs:
            ok = agreeing_configs(prints)
            for (_, cfg), good in zip(times, ok):
                if not good:
                    warnings.warn(f"{self.name}: config {cfg} for {kind} {key} gives another result than the other "
                                  "candidates (a miscompile or a kernel bug on this device); not picked", stacklevel=3)
            times = [x for x, good in zip(times, ok) if good]
        best = choose(times)
        self.best[full_key] = best
        if skey is not None:
            self._to_disk(skey, best, device)
        if os.environ.get("GEM_TUNE_LOG", "0") == "1":  # benchmarks print what the tuner chose, and by how much
            ranked = ", ".join(f"{c} {t:.3f}" for t, c in sorted(times, key=lambda x: x[0])[:4])
            print(f"{self.name} tuned {kind} {key}: {best} of {ranked} ms", flush=True)
        return best

    def _first_launching(self, full_key: tuple, cands: list, launch: Callable):
        """The first of cands that compiles and launches (kept for the key); the last one's error if none does."""
        for i, cfg in enumerate(cands):
            try:
                launch(cfg)
            except Exception as e:
                if i == len(cands) - 1 or not _config_error(e):
                    raise
                continue
            self.best[full_key] = cfg
            return cfg
        raise RuntimeError(f"{self.name}: no config for {full_key}")

    # ------------------------------------------------------------------------------------------- the disk cache
    def _from_disk(self, skey: str, cands: list, device: torch.device):
        if self._stored is None:
            self._stored = self._load(device)
        stored = self._stored.get(skey)
        if stored is None:
            return None
        for cfg in cands:  # a stale entry (candidates changed since) matches none and is timed again
            if _json_config(cfg) == stored:
                return cfg
        return None

    def _load(self, device: torch.device) -> dict:
        """Shipped defaults overlaid by the user's cache file, both for this op and environment; {} when off."""
        path = cache_file(self.name, device)
        if path is None:
            return {}
        env = environment(device)
        out = {}
        shipped = _read_json(SHIPPED)
        if shipped is not None:
            ok = isinstance(shipped, dict) and shipped.get("format") == FORMAT
            entries = shipped.get("entries") if ok else None
            if not isinstance(entries, list):
                _warn(SHIPPED, "not a tuning-defaults file of this gem version")
            else:
                for e in entries:
                    if _valid(e) and e["env"] == env and e["op"] == self.name:
                        out.update(e["configs"])
        if path.exists():
            body = _read_json(path)
            if body is not None and not (_valid(body) and "format" in body and body["env"] == env
                                         and body["op"] == self.name):
                _warn(path, f"not a {self.name} tuning file for {env}")
            elif body is not None:
                out.update(body["configs"])
        return out

    def _to_disk(self, skey: str, cfg, device: torch.device) -> None:
        """Merge one pick into this op's cache file (re-read first: other processes write it too), atomically."""
        path = cache_file(self.name, device)
        if path is None:
            return
        try:
            cfg_json = _json_config(cfg)
        except TypeError:
            return  # a config type the cache cannot express: kept in memory only
        if self._stored is not None:
            self._stored[skey] = cfg_json
        env = environment(device)
        body = _read_json(path, warn=False) if path.exists() else None
        if not (_valid(body) and body["env"] == env and body["op"] == self.name):
            body = {"format": FORMAT, "env": env, "op": self.name, "configs": {}}
        body["configs"][skey] = cfg_json
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(body, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            _warn(path, f"not written ({e.strerror or e})")


def fingerprint(tensors: tuple[torch.Tensor, ...]) -> tuple[int, float]:
    """(count of non-finite values, sum of |finite values| in float64) over a launch's outputs: equal between
    correct configs up to summation order, far apart when one is wrong."""
    bad, mag = 0, 0.0
    for t in tensors:
        x = t.detach()
        if x.dim() == 0 or x.numel() == 0:
            x = x.reshape(-1)
        # in slices of about 16M values along dim 0: the temporaries stay small beside a large output
        for part in x.split(max(1, (1 << 24) // max(1, x[0].numel())) if x.numel() else 1):
            part = part if part.is_floating_point() else part.double()
            finite = torch.isfinite(part)
            bad += int(finite.numel() - finite.sum())
            mag += float(torch.where(finite, part, 0).abs().sum(dtype=torch.float64))
    return bad, mag


AGREE_RTOL = 1e-3  # magnitudes agree within this fraction: summation order moves a sum of many values far less


def agreeing_configs(prints: list[tuple[int, float]]) -> list[bool]:
    """Which candidates' fingerprints agree with the reference: the one most others agree with (the earliest on
    ties, i.e. the shipped default when all disagree). Agreeing: the same non-finite count and magnitudes within
    AGREE_RTOL."""
    def agree(a, b):
        return a[0] == b[0] and abs(a[1] - b[1]) <= AGREE_RTOL * max(abs(a[1]), abs(b[1]))

    if not prints:
        return []
    support = [sum(agree(p, q) for q in prints) for p in prints]
    ref = prints[support.index(max(support))]
    return [agree(p, ref) for p in prints]


def choose(times: list[tuple[float, object]]):
    """The earliest candidate (in the given order: the first is the shipped default) within MARGIN of the fastest:
    a later candidate wins only when clearly faster, so timing noise does not flip the pick between processes."""
    fastest = min(t for t, _ in times)
    return next(cfg for t, cfg in times if t <= fastest * (1 + MARGIN))


def cache_dir() -> Path | None:
    """$GEM_TUNE_CACHE when set (`0` or empty: no cache, no shipped defaults: every process tunes), else
    $XDG_CACHE_HOME/gem/tuning, else ~/.cache/gem/tuning."""
    env = os.environ.get("GEM_TUNE_CACHE")
    if env is not None:
        return None if env in ("", "0") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gem" / "tuning"


def environment(device: torch.device) -> dict:
    """What a pick depends on besides the shape: the device model and the software that compiles the kernels."""
    import triton

    import gem

    if device.type == "cuda" and not triton_interpreting():
        name = torch.cuda.get_device_name(device)
    else:
        name = "interpreter" if triton_interpreting() else device.type
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__, "gem": gem.__version__}


def cache_file(op: str, device: torch.device) -> Path | None:
    root = cache_dir()
    if root is None:
        return None
    env = environment(device)
    slug = "-".join(_slug(env[k]) for k in ("device", "torch", "triton", "gem"))
    return root / slug / f"{_slug(op)}.json"


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+]+", "_", s).strip("_") or "_"


def _key_string(kind: str, key: tuple) -> str | None:
    """The key as JSON text (dtypes by name); None when a part has no stable text (then not cached on disk)."""
    try:
        return json.dumps([kind, *(_json_value(k) for k in key)], separators=(",", ":"))
    except TypeError:
        return None


def _json_value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    raise TypeError(f"no JSON form for {type(v).__name__}")


def _json_config(cfg):
    """A config as JSON data, as json.loads gives it back (tuples and NamedTuples as lists; triton.Config as its
    kwargs and launch options; LaunchConfig as its fields by name), for comparison with a stored one."""
    if isinstance(cfg, LaunchConfig):
        out = cfg.json()
    elif isinstance(cfg, dict):
        out = {str(k): _json_config(v) for k, v in cfg.items()}
    elif all(hasattr(cfg, a) for a in ("kwargs", "num_warps", "num_stages")):
        out = {"kwargs": _json_config(dict(cfg.kwargs)), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    else:
        out = _json_value(cfg)
    return json.loads(json.dumps(out))


def _valid(body) -> bool:
    """An entry of the shipped defaults, or (with "format") the body of a cache file."""
    return (isinstance(body, dict) and body.get("format", FORMAT) == FORMAT and isinstance(body.get("env"), dict)
            and isinstance(body.get("op"), str) and isinstance(body.get("configs"), dict))


def _read_json(path: Path, warn: bool = True):
    """The file's JSON data, or None (one warning line) when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        if warn:
            _warn(path, f"unreadable ({type(e).__name__})")
        return None


def _warn(path: Path, what: str) -> None:
    warnings.warn(f"gem tuning cache {path}: {what}; ignored", stacklevel=4)


def _config_error(e: Exception) -> bool:
    """True when a config cannot compile or launch (resources, compile errors); False for a fault on the device,
    which leaves the CUDA context unusable and must surface at once, not be retried with the next config."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(e, accel):
        return False
    msg = str(e)
    # torch reports "CUDA error: ...", Triton's launcher "Triton Error [CUDA]: ..."
    return not any(m in msg for m in ("CUDA error", "[CUDA]", "illegal memory access", "launch failure"))


# ------------------------------------------------------------------------------------------- resource estimates
# A tile config that needs more shared memory than the device has fails at launch (OutOfResources) on every shape
# of its key, e.g. fp32 tiles sized for bf16. The estimates below drop such candidates before any launch and pick
# smaller fallback tiles where none is left; a launch that still fails moves to the next config (ConfigTuner.pick).

SMEM_LIMIT = 227 * 1024  # bytes per program with opt-in on the H100 / H200; the interpreter's (no real limit)


def shared_memory_limit(device: torch.device) -> int:
    """The shared memory (bytes) one program may use on device; SMEM_LIMIT off the GPU."""
    if device.type == "cuda" and not triton_interpreting():
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_LIMIT)
    return SMEM_LIMIT


def attention_smem(stationary: int, streamed: int, stages: int, elt: int, scratch: int = 0) -> int:
    """Shared-memory estimate (bytes) of a tiled attention program, meant to stay below what Triton allocates, so a
    config it drops cannot fit: `stationary` elements staged once for the dots (the q tile of a forward, the K/V
    tile of a dK/dV pass), `streamed` elements loaded per loop step and buffered ahead `stages - 1` deep (at least
    one buffer), and, for fp32 operands (`elt` 4: dots on CUDA cores, whose operands pass through shared memory),
    `scratch` elements of the score tile as a dot operand; 16-bit dots take it from registers. `elt` bytes each."""
    return (stationary + streamed * max(int(stages) - 1, 1) + (scratch if elt >= 4 else 0)) * elt


def attention_pass_smem(pass_: str, width: int, elt: int) -> Callable:
    """The estimate (attention_smem) of a tile LaunchConfig of one attention pass at tile width `width`: the forward
    holds its q tile and streams K/V; dK/dV holds K/V and streams q/dO; dQ (any other pass) holds q/dO and streams
    K/V."""
    def estimate(cfg: LaunchConfig) -> int:
        bm, bn, stages = cfg.block_m, cfg.block_n, cfg.num_stages or 1
        if pass_ == "fwd":
            return attention_smem(bm * width, 2 * bn * width, stages, elt, bm * bn)
        if pass_ == "dkdv":
            return attention_smem(2 * bn * width, 2 * bm * width, stages, elt, bm * bn)
        return attention_smem(2 * bm * width, 2 * bn * width, stages, elt, bm * bn)
    return estimate


def fitting(cands: list, fallback: list, estimate: Callable, limit: int) -> tuple[list, list]:
    """(the candidates whose estimate fits `limit`, in order; the fallbacks that fit and are not among them, or the
    last, smallest fallback alone when none fits: tried rather than nothing)."""
    fit = [c for c in cands if estimate(c) <= limit]
    rest = [c for c in fallback if estimate(c) <= limit and c not in fit]
    return fit, rest or [c for c in list(fallback)[-1:] if c not in fit]
