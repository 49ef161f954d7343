"""`dspark import`: turn an upstream drafter (DeepSpec DSpark / DFlash / EAGLE-3, z-lab DFlash,
vLLM / SGLang EAGLE-3) into a drafter this project serves, and prove it against upstream outputs.

  dspark import --from deepspec DRAFTER_DIR --check                  what it found, nothing written
  dspark import --from deepspec DRAFTER_DIR --target TARGET_DIR --out OUT
  dspark import --from deepspec DRAFTER_DIR --target TARGET_DIR --verify reference.safetensors

DRAFTER_DIR is one upstream drafter directory (config.json + *.safetensors) or a folder of them
(every subfolder that holds a drafter is imported, into OUT/<kind>). `--verify` recomputes every
array of the reference file for the target and the imported drafters, prints the max |Δ| per
array and token equality, and exits 1 if anything is beyond tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "import",
        help="convert an upstream drafter (DeepSpec, z-lab DFlash, EAGLE-3) to our format; --check; --verify",
    )
    p.add_argument("drafter", metavar="DRAFTER_DIR", help="upstream drafter directory, or a folder of them")
    p.add_argument(
        "--from",
        dest="source",
        default="auto",
        choices=["auto", "deepspec", "z-lab", "vllm"],
        help="the layout you expect (auto: detect from config.json and the tensor names)",
    )
    p.add_argument(
        "--target", default=None, help="the target's HF checkpoint directory (config.json + safetensors)"
    )
    p.add_argument("--out", default=None, help="where our drafter goes (default artifacts/imported/<name>)")
    p.add_argument(
        "--check", action="store_true", help="print what was found (and target fit); write nothing"
    )
    p.add_argument("--verify", default=None, metavar="REFERENCE", help="reference.safetensors to recompute")
    p.add_argument(
        "--layer-ids",
        default=None,
        help="target layer ids to tap, comma-separated (raw decoder-layer outputs; -1 = embeddings, write "
        "--layer-ids=-1,...): "
        "overrides config.json",
    )
    p.add_argument(
        "--mask-token-id", type=int, default=None, help="DSpark/DFlash MASK token id: overrides config.json"
    )
    p.add_argument("--atol", type=float, default=1e-4, help="--verify tolerance on float arrays (fp32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own setting)")
    p.set_defaults(fn=run)


def _drafter_dirs(root: Path) -> list[Path]:
    """The upstream drafter directories under `root` (itself, or its subfolders)."""
    from dspark.models.importers import CheckpointError, inspect

    if (root / "config.json").exists():
        return [root]
    found = []
    for d in sorted(p for p in root.iterdir() if (p / "config.json").exists()):
        try:
            inspect(d)
        except CheckpointError:
            continue  # a target or something else: not a drafter
        found.append(d)
    if not found:
        raise FileNotFoundError(
            f"{root}: no config.json, and no subfolder holds a drafter this importer knows"
        )
    return found


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark.models.importers import CheckpointError, check_target, import_drafter, inspect

    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.drafter)
    if not root.is_dir():
        print(f"error: {root} is not a directory", file=sys.stderr)
        return 2
    if not args.check and args.target is None:
        print("error: --target TARGET_DIR is required to convert (or use --check)", file=sys.stderr)
        return 2
    try:
        dirs = _drafter_dirs(root)
        ids = None
        if args.layer_ids:
            try:
                ids = [int(x) for x in args.layer_ids.split(",") if x.strip()]
            except ValueError:
                raise ValueError(
                    f"--layer-ids wants integers like 1,9,17,25,33, got {args.layer_ids!r}"
                ) from None
        ups = [inspect(d, ids, args.mask_token_id) for d in dirs]
        for up in ups:
            if args.source != "auto" and up.source != args.source:
                raise CheckpointError(
                    f"{up.path}: this is a {up.source} {up.kind} checkpoint ({up.architecture}), not --from "
                    f"{args.source}"
                )
        tcfg = None
        if args.target is not None:
            from dspark.models.importers import target_head_tensors

            tcfg = target_head_tensors(Path(args.target))[0]
        for up in ups:
            print(up.summary())
            if tcfg is not None:
                check_target(up, tcfg)
                print(
                    f"target       {args.target}: {tcfg.family}, {tcfg.num_layers} layers, hidden "
                    f"{tcfg.hidden_size}, vocabulary {tcfg.vocab_size}: fits"
                )
            print()
        if args.check:
            return 0
        outs = {}
        for up in ups:
            if args.out is None:
                out = Path("artifacts/imported") / (up.path.name if len(ups) == 1 else up.kind)
            else:
                out = Path(args.out) if len(ups) == 1 else Path(args.out) / up.kind
            import_drafter(up.path, Path(args.target), out, ids, args.mask_token_id)
            outs[up.kind] = out
            print(f"[import] {up.path} → {out} ({up.kind}, {str(up.dtype).removeprefix('torch.')})")
        for kind, out in outs.items():
            if kind != "eagle3":
                print(f"[import] next: dspark engines --target {args.target} --drafter {out}")
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.verify:
        return _verify(Path(args.verify), Path(args.target), outs, args.atol)
    return 0


def _verify(reference: Path, target: Path, outs: dict[str, Path], atol: float) -> int:
    from dspark.models.import_verify import Drafter, verify
    from dspark.models.loading import load_target
    from dspark.training.pipeline import load_drafter

    if not reference.exists():
        print(f"error: no reference file {reference}", file=sys.stderr)
        return 2
    loaded = load_target(str(target))
    drafters = {}
    for kind, out in outs.items():  # through our checkpoint format, as serving loads it
        model, _ = load_drafter(str(out), loaded)
        meta = json.loads((out / "drafter.json").read_text()).get("imported", {})
        drafters[kind] = Drafter(model, meta.get("mask_token_id"))
    print(f"[verify] recomputing {reference} with target {target} and drafters {sorted(drafters)}")
    rows = verify(reference, loaded.model, drafters, atol)
    failed = [r.name for r in rows if r.failed]
    checked = {n.split(".")[0] for n in (r.name for r in rows if r.status == "ok" or r.failed)}
    missing = [k for k in drafters if k not in checked]
    if missing:
        print(f"[verify] the reference holds no arrays for {missing}", file=sys.stderr)
    if failed:
        print(f"[verify] FAILED: {len(failed)} array(s) beyond tolerance: {failed}", file=sys.stderr)
        return 1
    if missing:
        return 1
    print("[verify] every array matches")
    return 0
