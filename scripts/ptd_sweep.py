"""PTD's speed/acceptance curve against the tokens it feeds per forward, on held-out prompts.

The command docs/ptd.md quotes; the sweep itself lives in specflash/bench_ptd.py (also
`python -m specflash.bench_ptd`), where notebook 04 imports it from.

    python scripts/ptd_sweep.py --domains code,math --prompts-per-domain 2 --max-new-tokens 64
"""

from specflash.bench_ptd import main

if __name__ == "__main__":
    raise SystemExit(main())
