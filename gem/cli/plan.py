"""`gem plan [--search] experiment=... topology.hosts=64 topology.gpus_per_host=8 ...`: plan a run on a cluster.

Arguments: `topology.*` (gem.plan.topology.ClusterSpec), `plan.*` (gem.plan.estimate.PlanOptions) and any
training config override (composed from the same configs as `gem-train`). Exit 0 with the report, 2 with one
`gem-plan: error: ...` line when the config is bad or does not fit.
"""

from __future__ import annotations

import sys
import time

from gem.config import EXIT_USER, UserError, error_line, parse_args
from gem.plan.topology import GB, PlanError

USAGE = __doc__.strip().splitlines()[0]
TOOL = "gem-plan"
SECTIONS = ("topology", "plan")


def _err(msg: str) -> None:
    print(error_line(TOOL, msg), file=sys.stderr, flush=True)


def compose(overrides: list[str], config_dir: str | None = None):
    """The typed training configs for these overrides (a UserError with gem-train's one-line message)."""
    return compose_all(overrides, config_dir)[0]


def compose_all(overrides: list[str], config_dir: str | None = None):
    """(typed training configs, {"topology": {...}, "plan": {...}}) from one composition of `overrides`."""
    from gem.config import compose as compose_config
    from gem.train.trainer import build_configs

    cfg, sections = compose_config(overrides, extra_dir=config_dir, job_name="gem_plan", sections=SECTIONS)
    return build_configs(cfg), sections


def _gb(b: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:7.2f} {unit}"
    return f"{b:7.0f} B "


def format_report(est, cfgs) -> str:
    from gem.parallel.dims import ParallelDims

    c, p, d, w = est.cluster, est.par, est.dense, est.work
    n_sparse = sum(t.num_embeddings * t.embedding_dim for t in cfgs.model.tables)
    lines = [
        (f"cluster: {c.hosts} hosts x {c.gpus_per_host} GPUs = {c.world} ranks, HBM {c.hbm_gb:g} GB/GPU, DDR "
        f"{c.ddr_gb:g} GB/host, links {c.intra_gbps:g} GB/s in a host, {c.inter_gbps:g} GB/s across hosts"),
        (f"model: {cfgs.model.name}: {n_sparse / 1e9:.1f}B sparse parameters, {d.detail['total_numel'] / 1e9:.2f}B "
        f"dense; per rank: batch {w.batch}, {w.tokens} history tokens, {w.flops / 1e12:.1f} TFLOP per step"),
        "layout: " + ParallelDims(cfg=p, world_size=c.world, rank=0, local_world_size=c.gpus_per_host,
                                  device=None).describe(),
        "",
        f"embedding sharding plan (torchrec planner, one group of {p.emb_shard_group} ranks; every group the same):",
    ]
    for module_plan in est.emb.plan.plan.values():
        for name, ps in module_plan.items():
            shards = ps.sharding_spec.shards if ps.sharding_spec is not None else []
            ranks = sorted({s.placement.rank() for s in shards})
            span = f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}" if ranks else "-"
            lines.append(f"  {name:16s} {ps.sharding_type:18s} {ps.compute_kernel:18s} {len(shards):4d} shards "
                         f"on {span}")
    hbm_e = [v for v in est.emb.hbm.values()]
    ddr_e = [v for v in est.emb.ddr.values()]
    lines += [
        (f"  tables per rank: HBM max {_gb(max(hbm_e))} min {_gb(min(hbm_e))}; DDR max {_gb(max(ddr_e))} "
        f"min {_gb(min(ddr_e))}"),
        "",
        "dense memory per rank (" + ("FSDP shards over dp_shard, experts over ep x dp_shard/ep):"
                                     if p.dense == "fsdp" else "DDP: a full copy on every rank):"),
        (f"  params {_gb(d.params)}  grads {_gb(d.grads)}  AdamW state {_gb(d.optimizer)}  gathered units "
        f"{_gb(d.gathered)}  activations (estimate) {_gb(d.activations)}  = {_gb(d.total)}"),
        (f"HBM per rank: max {_gb(max(est.hbm.values()))} of {_gb(c.hbm_bytes)} (rank "
        f"{max(est.hbm, key=est.hbm.get)}); DDR per rank: max {_gb(max(est.ddr.values()))} of "
        f"{_gb(c.ddr_bytes_per_rank)}"),
        "",
        "communication per rank per step (buffer bytes; time at the group's per-GPU bandwidth):",
    ]
    for col in est.collectives:
        where = "across hosts" if c.spans_hosts(col.ranks) else "in a host"
        lines.append(f"  {col.name:42s} {col.op:14s} over {col.group:15s} ({col.size:3d} ranks, {where:12s}) "
                     f"{_gb(col.bytes)} {1e3 * col.seconds(c):8.2f} ms")
    s = w.straggler
    lines += [
        "",
        (f"rank imbalance (E[max]/mean of per-rank FLOPs over {c.world} ranks, lengths from data.histories): "
         f"{s.none:.3f} as drawn, {s.cost:.3f} with data.balance=cost; this run (data.balance={w.balance}): "
         f"x{w.straggler_factor:.3f} on compute"),
        (f"step time (estimate): compute {est.compute_ms:.2f} ms (scaled by FLOPs from the measured reference step, "
         f"slowest rank) "
        f"+ communication {est.comm_ms:.2f} ms = {est.step_ms:.2f} ms without overlap, {est.overlapped_ms:.2f} ms "
        f"if all communication hides behind compute"),
        f"torchrun overrides: {est.overrides()}",
    ]
    return "\n".join(lines)


def plan(argv: list[str]) -> int:
    from gem.parallel.dims import ParallelConfigError
    from gem.parallel.dims import validate as validate_parallel
    from gem.plan.estimate import LAYOUT_KEYS, PlanOptions, estimate, ref_rate, workload
    from gem.plan.search import format_search, search
    from gem.plan.topology import ClusterSpec

    t0 = time.perf_counter()
    args = parse_args(argv)
    unknown = [f for f in args.flags if f != "--search"]
    if unknown:
        raise PlanError(f"{unknown[0]}: unknown option (usage: {USAGE})")
    do_search, overrides = "--search" in args.flags, args.overrides
    cfgs, sections = compose_all(overrides, args.config_dir)
    cluster = ClusterSpec.from_dict(sections["topology"])
    options = PlanOptions.from_dict(sections["plan"])
    ref = compose([f"experiment={options.ref_experiment}"], args.config_dir)
    rate = ref_rate(ref, options.ref_step_ms, options.seed)
    if do_search:
        ranked = search(cfgs, cluster, rate, options)
        layout_keys = {f"parallel.{k}" for k in LAYOUT_KEYS}
        ranked.user_overrides = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in layout_keys
                                 and o.split(".", 1)[0].lstrip("+~") not in SECTIONS]
        print(format_search(ranked, cfgs, cluster, options), flush=True)
    else:
        try:
            par = validate_parallel(cfgs.parallel, cluster.world)
        except ParallelConfigError as e:
            raise PlanError(str(e)) from None
        work = workload(cfgs, options.seed, cluster.world, options.straggler_batches)
        est = estimate(cfgs, par, cluster, rate, seed=options.seed, work=work)
        print(format_report(est, cfgs), flush=True)
    print(f"(planned in {time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


def usage() -> str:
    import dataclasses

    from gem.plan.estimate import PlanOptions
    from gem.plan.topology import ClusterSpec

    lines = [__doc__.strip(), ""]
    for prefix, cls in (("topology", ClusterSpec), ("plan", PlanOptions)):
        for f in dataclasses.fields(cls):
            v = getattr(cls(), f.name)
            v = "null" if v is None else f"[{','.join(map(str, v))}]" if isinstance(v, tuple) else v
            lines.append(f"  {prefix}.{f.name}={v}")
    lines.append("Units: GB = 1e9 bytes; *_gbps = GB/s per GPU. Guide: docs/PLAN.md")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gem.cli.quiet import quiet_third_party

    quiet_third_party()
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        return plan(argv)
    except UserError as e:  # PlanError, config errors
        _err(str(e).splitlines()[0])
        return EXIT_USER


def run(argv: list[str] | None = None) -> None:
    """The console script: main's status as the process's."""
    sys.exit(main(argv))


if __name__ == "__main__":
    run()
