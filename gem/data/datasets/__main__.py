"""`python -m gem.data.datasets NAME --raw DIR --out DIR`: convert a public dataset (see gem/data/datasets)."""

from __future__ import annotations

import argparse
import sys

from gem.data.datasets import DATASETS, MAX_CANDIDATES, REQUEST_DATASETS, REQUEST_GAP_S, RawError, convert, preset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gem.data.datasets", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(DATASETS), help="the dataset")
    p.add_argument("--raw", required=True, help="folder holding the downloaded, unpacked raw files")
    p.add_argument("--out", required=True, help="output folder: train/, eval/ and schema.yaml are written there")
    p.add_argument("--max-len", type=int, default=64, help="longest history kept per example (the newest events)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training rows' shuffle")
    p.add_argument("--max-bad", type=int, default=0,
                   help="skip up to this many malformed rows (each reported with file and line); 0: stop at the first")
    p.add_argument("--rows-per-file", type=int, default=1_000_000, help="rows (examples or requests) per Parquet file")
    p.add_argument("--form", choices=["rows", "requests"], default="rows",
                   help=f"rows: one example per event; requests ({', '.join(REQUEST_DATASETS)}): one row per request, "
                        "its candidates and labels as lists")
    p.add_argument("--max-candidates", type=int, default=None,
                   help=f"requests: most candidates per request; a longer session is cut into near-equal requests "
                        f"(default {MAX_CANDIDATES})")
    p.add_argument("--request-gap", type=float, default=None,
                   help=f"requests: a pause of more than this many seconds between a user's events starts a new "
                        f"request (default {REQUEST_GAP_S:g})")
    args = p.parse_args(argv)
    try:
        done = convert(args.name, args.raw, args.out, max_len=args.max_len, seed=args.seed, max_bad=args.max_bad,
                       rows_per_file=args.rows_per_file, form=args.form, max_candidates=args.max_candidates,
                       request_gap_s=args.request_gap)
    except (RawError, ValueError, OSError) as e:
        print(f"gem.data.datasets: error: {e}", file=sys.stderr, flush=True)
        return 2
    cards = {t: spec["num_embeddings"] for t, spec in done.schema["tables"].items()}
    skipped = f", {done.skipped} malformed rows skipped" if done.skipped else ""
    if done.form == "rows":
        print(f"{args.name}: {done.train_rows} train and {done.eval_rows} eval examples in {done.out}{skipped}")
    else:
        print(f"{args.name}: {done.train_rows} train and {done.eval_rows} eval requests ({done.train_candidates} and "
              f"{done.eval_candidates} candidates) in {done.out}{skipped}")
    print("table sizes: " + " ".join(f"{k}={v}" for k, v in cards.items()))
    k = f" data.max_candidates={done.schema['max_candidates']}" if done.form == "requests" else ""
    print(f"train: gem-train experiment={preset(args.name, done.form)} data.paths='[{done.out}/train/*.parquet]' "
          f"data.eval_paths='[{done.out}/eval/*.parquet]' data.histories.events.max_len={args.max_len}{k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
