"""`gem plan --search`: every layout the cluster allows, ranked by estimated step time among those that fit.

Layouts: dp_replicate x dp_shard = world, ep | dp_shard (and | num_experts), emb_shard_group from
`plan.emb_groups` (default: the powers of two from one host to the world that divide it), emb_sync_every from
`plan.sync_every` (1 when there is one embedding group). The planner runs once per group size, keeping HBM for
the lightest dense layout; a layout that overflows a rank with that plan is planned again keeping HBM for its own
dense part (as `gem plan` does, which may put tables in host memory: UVM caching), unless its estimate on the
shared plan is already slower than the best `plan.top` layouts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gem.parallel.dims import ParallelConfig, ParallelConfigError
from gem.parallel.dims import validate as validate_parallel
from gem.plan.estimate import Estimate, PlanOptions, activation_bytes, estimate, reserve_for, workload
from gem.plan.memory import dense_memory, fsdp_units
from gem.plan.sharding import EmbeddingPlan, plan_embeddings
from gem.plan.topology import ClusterSpec, PlanError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfgs, cluster: ClusterSpec, options: PlanOptions) -> list:
    """Validated ParallelConfigs of every combination (other parallel keys kept from the config)."""
    world = cluster.world
    moe = any(cfgs.model.is_moe_block(i) for i in range(cfgs.model.tower.num_blocks))
    groups = options.emb_groups or tuple(g for g in divisors(world)
                                         if g & (g - 1) == 0 and g >= min(cluster.gpus_per_host, world))
    from gem.parallel.embedding import check_zch_layout

    base = dataclasses.replace(cfgs.parallel, dense="fsdp")
    zch = [t.name for t in cfgs.model.tables if t.zch is not None]
    out = []
    for shard in divisors(world):
        eps = [e for e in divisors(shard) if e == 1 or (moe and cfgs.model.moe.num_experts % e == 0)]
        for ep in eps:
            for g in groups:
                syncs = options.sync_every if world // g > 1 else (1,)
                for k in syncs:
                    c = dataclasses.replace(base, dp_replicate=world // shard, dp_shard=shard, ep=ep,
                                            emb_shard_group=g, emb_sync_every=k)
                    try:
                        c = validate_parallel(c, world)
                        check_zch_layout(zch, c, world)  # hash: zch tables: one sharding group
                    except ParallelConfigError:
                        continue
                    out.append(c)
    return out


@dataclass
class SearchResult:
    fits: list[Estimate]
    rejected: list[tuple[ParallelConfig, str]] = field(default_factory=list)  # (layout, why it does not fit)
    skipped: list[ParallelConfig] = field(default_factory=list)  # overflow the shared plan, slower than the best
    user_overrides: list[str] = field(default_factory=list)


def search(cfgs, cluster: ClusterSpec, flops_per_ms: float, options: PlanOptions) -> SearchResult:
    work = workload(cfgs, options.seed, cluster.world, options.straggler_batches)
    layouts = candidate_layouts(cfgs, cluster, options)
    units = {ep > 1: fsdp_units(cfgs.model, ep, cfgs.train.precision, cfgs.train.precision_filter)
             for ep in {p.ep for p in layouts}}
    act = activation_bytes(cfgs, cluster)
    dense = {id(p): dense_memory(units[p.ep > 1], cfgs.model, p, work.history_tokens or work.tokens, act,
                                cfgs.activation_checkpoint, cfgs.train.param_dtype)
             for p in layouts}
    result = SearchResult(fits=[])
    plans: dict[tuple[int, int], EmbeddingPlan | None] = {}

    def plan_for(g: int, dense_bytes: int) -> EmbeddingPlan | None:
        key = (g, reserve_for(dense_bytes, cluster))
        if key not in plans:
            try:
                plans[key] = plan_embeddings(cfgs.model, cluster, g, work.batch, cfgs.parallel.sharding_types,
                                             reserve_bytes=key[1])
            except PlanError:
                plans[key] = None
        return plans[key]

    lightest: dict[int, int] = {}
    for p in layouts:
        if dense[id(p)].total <= cluster.hbm_bytes:
            g = p.emb_shard_group
            lightest[g] = min(lightest.get(g, dense[id(p)].total), dense[id(p)].total)
    # every layout on its group size's shared plan; those that overflow it are planned again (keeping HBM for
    # their own dense part) only while they could still rank among the best `top`
    shared = []
    for p in layouts:
        g, need = p.emb_shard_group, dense[id(p)].total
        if need > cluster.hbm_bytes:
            result.rejected.append((p, (f"rank 0 needs {need} bytes of HBM for the dense part alone; it has "
                                       f"{cluster.hbm_bytes}")))
            continue
        emb = plan_for(g, lightest[g])
        if emb is None:
            shared.append((float("inf"), p, None))
            continue
        shared.append((estimate(cfgs, p, cluster, flops_per_ms, emb=emb, units=units[p.ep > 1], work=work,
                                check=False), p, emb))
    shared.sort(key=lambda x: x[0] if isinstance(x[0], float) else x[0].step_ms)
    for est, p, emb in shared:
        if emb is not None and est.overflow() is None:
            result.fits.append(est)
            continue
        bound = est if isinstance(est, float) else est.step_ms
        if len(result.fits) >= options.top and bound > sorted(e.step_ms for e in result.fits)[options.top - 1]:
            result.skipped.append(p)
            continue
        own = plan_for(p.emb_shard_group, dense[id(p)].total)
        if own is None:
            result.rejected.append((p, (f"the tables do not fit in groups of {p.emb_shard_group} ranks next to "
                                       f"{dense[id(p)].total} bytes of dense state per rank")))
            continue
        est = estimate(cfgs, p, cluster, flops_per_ms, emb=own, units=units[p.ep > 1], work=work, check=False)
        problem = est.overflow()
        if problem:
            result.rejected.append((p, problem))
        else:
            result.fits.append(est)
    result.fits.sort(key=lambda e: (e.step_ms, e.overlapped_ms))
    return result


def format_search(result: SearchResult, cfgs, cluster: ClusterSpec, options: PlanOptions) -> str:
    n = len(result.fits) + len(result.rejected) + len(result.skipped)
    lines = [f"{n} layouts on {cluster.hosts} x {cluster.gpus_per_host} ranks: {len(result.fits)} fit, "
             f"{len(result.rejected)} do not"
             + (f", {len(result.skipped)} not planned again (slower than the best {options.top} even if they fit)"
                if result.skipped else "")]
    if not result.fits:
        raise PlanError(f"no layout fits on {cluster.world} ranks of {cluster.hbm_bytes} bytes of HBM")
    lines.append(f"{'#':>2} {'step ms':>9} {'compute':>8} {'comm':>8} {'overlap':>8} {'HBM GB':>7}  layout")
    for i, e in enumerate(result.fits[:options.top], 1):
        p = e.par
        lines.append(f"{i:2d} {e.step_ms:9.2f} {e.compute_ms:8.2f} {e.comm_ms:8.2f} {e.overlapped_ms:8.2f} "
                     f"{max(e.hbm.values()) / 1e9:7.1f}  dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} "
                     f"ep={p.ep} emb_shard_group={p.emb_shard_group} emb_sync_every={p.emb_sync_every}")
    lines.append("")
    lines.append("overrides of the best layouts (append to the torchrun command):")
    user = " ".join(result.user_overrides)
    for i, e in enumerate(result.fits[:options.top], 1):
        lines.append(f"  {i}: {(user + ' ') if user else ''}{e.overrides()}")
    lines.append(f"e.g. torchrun --nnodes {cluster.hosts} --nproc-per-node {cluster.gpus_per_host} "
                 f"--rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m gem.train {(user + ' ') if user else ''}"
                 f"{result.fits[0].overrides()}")
    return "\n".join(lines)
