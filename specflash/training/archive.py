"""Token-only copies of harvest folders, small enough to commit, so the drafter's data outlives
the machine that made it.

A harvest folder costs hours of target generation (about 94 answer tokens/s per core here) and
weighs about 1 MB per sample, almost all of it the captured features; the samples themselves are
about 1 kB. The features are a function of the tokens (a teacher-forced forward reproduces them
to float16 rounding, tests/test_harvest.py), so the committed copy keeps the token shards, the
manifest and the self-prompted requests, and drops the features. Every trainer reads such a
folder directly (`dflash_features.shard_features` recomputes each shard's features once and caches
them), and `--restore` copies it back into the cache, where `harvest` resumes it.

    python -m specflash.training.archive HARVEST_FOLDER... [--to data/harvests]
    python -m specflash.training.archive data/harvests/<model>/harvest-<key> --restore
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

import platformdirs

from ..errors import SpecFlashError
from .data import MANIFEST, read_manifest
from .entry import run_script

DEFAULT_ARCHIVE = Path("data") / "harvests"
REQUESTS = "self-prompts.jsonl"  # the self-prompts source's requests: a resumed harvest needs them


def _harvest_manifest(folder: Path) -> dict:
    manifest = read_manifest(folder)
    if manifest is None:
        raise SpecFlashError(f"{folder} has no {MANIFEST}: not a data folder")
    if not manifest.get("harvest"):
        raise SpecFlashError(f"{folder} was not made by specflash.training.harvest")
    return manifest


def _copy_tokens(src: Path, dst: Path, manifest: dict) -> list[str]:
    """Copy the listed shards `dst` lacks, the requests, then the manifest (last, so a listed
    shard is always there); returns the shard files copied."""
    missing = [s["file"] for s in manifest["shards"] if not (src / s["file"]).is_file()]
    if missing:
        raise SpecFlashError(f"{src} lists shards it does not hold: {', '.join(missing)}")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for shard in manifest["shards"]:
        target = dst / shard["file"]
        if not target.is_file() or target.stat().st_size != (src / shard["file"]).stat().st_size:
            shutil.copyfile(src / shard["file"], target)
            copied.append(shard["file"])
    if (src / REQUESTS).is_file():
        shutil.copyfile(src / REQUESTS, dst / REQUESTS)
    shutil.copyfile(src / MANIFEST, dst / MANIFEST)
    return copied


def pack(folder: Path, archive: Path) -> tuple[Path, list[str]]:
    """Bring `archive/<model>/<folder name>` up to date with a harvest folder, without features."""
    manifest = _harvest_manifest(folder)
    dst = archive / manifest["model"] / folder.name
    known = read_manifest(dst)
    if known is not None and len(known["shards"]) > len(manifest["shards"]):
        raise SpecFlashError(f"{dst} holds more shards ({len(known['shards'])}) than {folder} "
                             f"({len(manifest['shards'])}); refusing to shrink the archive")
    return dst, _copy_tokens(folder, dst, manifest)


def restore(folder: Path, cache: Path) -> tuple[Path, list[str]]:
    """Copy an archived folder to `cache/<model>/<folder name>` (where `harvest` keeps it) unless
    the cache already holds as many shards; its features are recomputed when first read."""
    manifest = _harvest_manifest(folder)
    dst = cache / manifest["model"] / folder.name
    known = read_manifest(dst)
    if known is not None and len(known["shards"]) >= len(manifest["shards"]):
        return dst, []
    return dst, _copy_tokens(folder, dst, manifest)


def run(args: argparse.Namespace) -> list[tuple[Path, list[str]]]:
    if args.restore:
        return [restore(f, args.cache) for f in args.folders]
    return [pack(f, args.to) for f in args.folders]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.archive", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", type=Path, nargs="+", help="harvest folders (with --restore: archived folders)")
    p.add_argument("--to", type=Path, default=DEFAULT_ARCHIVE, help="archive root (default: data/harvests)")
    p.add_argument("--restore", action="store_true", help="copy archived folders back into the harvest cache")
    p.add_argument("--cache", type=Path, default=Path(platformdirs.user_cache_dir("specflash")) / "data",
                   help="harvest cache root for --restore (default: the per-user cache)")
    return p.parse_args(argv)


def _summary(results: list[tuple[Path, list[str]]]) -> str:
    return "\n".join(f"{dst}: {len(copied)} shard(s) copied" for dst, copied in results)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(parse_args(argv), run, _summary)


if __name__ == "__main__":
    raise SystemExit(main())
