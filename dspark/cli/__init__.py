"""The `dspark` command line: one subcommand module per stage of the pipeline.

demo, generate          dspark.cli.demo       the product in one command; one prompt in-process
data, train, eval,      dspark.cli.training   regenerate answers, train drafters, measure acceptance
report
engines                 dspark.cli.engines    ONNX export + engine builds + manifest
serve, generate --url   dspark.cli.serve      tritonserver on loopback, the streaming client
sps, bench, gpu-check   dspark.cli.perf       perf_analyzer SPS(B) sweep, the serving benchmark, the GPU check
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from dspark.cli import demo, deploy, engines, importer, perf, serve, training

    p = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding, compiled and served")
    sub = p.add_subparsers(dest="cmd", required=True)
    demo.add_parsers(sub)
    training.add_parsers(sub)
    importer.add_parser(sub)
    engines.add_parser(sub)
    serve.add_parsers(sub)
    perf.add_parsers(sub)
    deploy.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) <= 0:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
