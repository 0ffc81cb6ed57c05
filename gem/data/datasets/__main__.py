"""`python -m gem.data.datasets NAME --raw DIR --out DIR`: convert a public dataset (see gem/data/datasets)."""

from __future__ import annotations

import argparse
import sys

from gem.data.datasets import DATASETS, RawError, convert


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gem.data.datasets", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=sorted(DATASETS), help="the dataset")
    p.add_argument("--raw", required=True, help="folder holding the downloaded, unpacked raw files")
    p.add_argument("--out", required=True, help="output folder: train/, eval/ and schema.yaml are written there")
    p.add_argument("--max-len", type=int, default=64, help="longest history kept per example (the newest events)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training rows' shuffle")
    p.add_argument("--max-bad", type=int, default=0,
                   help="skip up to this many malformed rows (each reported with file and line); 0: stop at the first")
    p.add_argument("--rows-per-file", type=int, default=1_000_000, help="rows per Parquet file")
    args = p.parse_args(argv)
    try:
        done = convert(args.name, args.raw, args.out, max_len=args.max_len, seed=args.seed, max_bad=args.max_bad,
                       rows_per_file=args.rows_per_file)
    except (RawError, ValueError, OSError) as e:
        print(f"gem.data.datasets: error: {e}", file=sys.stderr, flush=True)
        return 2
    cards = {t: spec["num_embeddings"] for t, spec in done.schema["tables"].items()}
    skipped = f", {done.skipped} malformed rows skipped" if done.skipped else ""
    print(f"{args.name}: {done.train_rows} train and {done.eval_rows} eval examples in {done.out}{skipped}")
    print("table sizes: " + " ".join(f"{k}={v}" for k, v in cards.items()))
    preset = args.name.replace("-", "_") if args.name != "kuairand" else "kuairand_pure"
    print(f"train: gem-train experiment={preset} data.paths='[{done.out}/train/*.parquet]' "
          f"data.eval_paths='[{done.out}/eval/*.parquet]' data.histories.events.max_len={args.max_len}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
