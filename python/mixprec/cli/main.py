"""The `mixprec` command. `mixprec compare` trains one model from the same initial weights under
every requested precision mode (mixprec's O-levels and the torch.amp baselines), prints a table,
a recommendation and whether to switch from torch.amp, and writes report.json, curves.png and
(with --tensorboard) TensorBoard logs; `mixprec env` prints what a bug report needs;
`mixprec --version`. docs/compare.md is the manual."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Optional, Sequence

import torch

from .modes import BASELINE, all_modes, default_modes, parse_modes
from .report import OOM, OK, add_relative_figures, memory_comparable, recommend, state_lines, table, write_json
from .runner import RunConfig, run_mode, warm_up
from .task import TaskError, load_entry_point
from .verdict import versus_torch

EMBEDDED = "mixprec.cli.embedded:make_task"
PROG = "mixprec compare"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (and exit status 2), like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # Defaults are written into each help text where they say something (no formatter appends
    # "(default: ...)" a second time, or "(default: None)" where None means "decided at run time").
    parser = _Parser(prog="mixprec", description="mixprec: mixed-precision training tools.")
    parser.add_argument("--version", action="version",
                        version=f"mixprec {_version()} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    sub.add_parser("env", prog="mixprec env", help="print mixprec, torch, CUDA, GPU and build facts for a bug report",
                   description="Print the versions and build facts a bug report needs: mixprec, torch, CUDA "
                               "runtime and driver, GPUs, whether mixprec's CUDA kernels were built and for which "
                               "architectures, Python and the platform.")
    p = sub.add_parser("compare", prog=PROG,
                       help="train a model under every precision mode and recommend one",
                       description="Train the same model from the same initial weights under each precision "
                                   "mode (O0 fp32, O1/O2/O3 in fp16 and bf16, the lean bf16 modes O2-bf16-rem, "
                                   "O3-bf16-sr and O2-bf16-fp8, and torch.amp in fp16 and bf16), "
                                   "compare time, memory, losses and validation metric, recommend the fastest "
                                   "mode that keeps O0's accuracy, and say whether to switch from torch.amp.")
    p.add_argument("--task", default=EMBEDDED,
                   help="'package.module:function' or 'file.py:function' returning a mixprec.cli.Task (or a "
                        "tuple model, optimizer, loss_fn, train_loader, val_loader[, metric_fn]); default: "
                        "the embedded tiny transformer")
    modes_help = ", ".join(all_modes())
    p.add_argument("--modes", default="default",
                   help=f"comma-separated modes ({modes_help}; 'O2' means both dtypes, 'torch' both torch.amp "
                        "modes; 'all'). Default: 'default', every mode on a GPU and O0 plus the bf16 modes on a "
                        "CPU, except O2-bf16-fp8 (on a CPU a slow emulation, marked 'emulated' when asked for). "
                        "O0 always runs, first")
    p.add_argument("--epochs", type=_positive, default=3,
                   help="epochs per mode; the first is warm-up for timing (default: %(default)s)")
    p.add_argument("--steps-per-epoch", type=_positive, default=None,
                   help="cap on training batches per epoch (default: the whole loader)")
    p.add_argument("--val-steps", type=_positive, default=None,
                   help="cap on validation batches (default: the whole loader)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--out", default="mixprec-compare", help="output directory (default: %(default)s)")
    p.add_argument("--tensorboard", action="store_true",
                   help="write TensorBoard logs to OUT/tensorboard/<date-time>/<mode>, with the comparison in "
                        "the HParams view")
    p.add_argument("--tolerance", type=_fraction, default=0.02,
                   help="largest relative loss of validation metric a recommended mode may have against O0's, "
                        "and a mode worth switching to against the best torch.amp mode's (default: %(default)s)")
    p.add_argument("--max-skipped", type=_fraction, default=0.05,
                   help="largest fraction of skipped (overflowing) steps a recommended mode may have "
                        "(default: %(default)s)")
    p.add_argument("--patience", type=_positive, default=20,
                   help="a mode diverged after this many overflowing steps in a row with the loss scale at its "
                        "floor, or this many non-finite losses in a row (default: %(default)s)")
    p.add_argument("--debug-forward", action="store_true",
                   help="name the first module whose forward output is non-finite (slow: checks every output)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the initial weights and the data order (default: %(default)s)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: when stderr is a terminal)")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=None,
                   help="write curves.png (default: when matplotlib is installed; --plot requires it)")
    return parser


def _say(msg: str) -> None:
    print(msg, flush=True)


def _error(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    n = torch.get_num_threads()
    return f"cpu ({platform.processor() or platform.machine()}, {n} thread{'' if n == 1 else 's'})"


def _summary(r) -> str:
    if r.status == OK:
        return (f"{r.mode}: ok, {r.time_per_epoch:.3f} s/epoch, val loss {r.val_loss:.4f}, "
                f"val metric {r.val_metric:.4f}, skipped {r.skipped_steps}/{r.steps}")
    return f"{r.mode}: {r.status}: {r.error}"


def compare(args: argparse.Namespace) -> int:
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as e:
        _error(f"bad --device {args.device!r}: {e}")
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        _error(f"--device {args.device} asked for, but CUDA is not available")
        return 2
    try:
        modes = parse_modes(args.modes, device)
    except ValueError as e:
        _error(str(e))
        return 2
    if args.tensorboard:
        from .tb_logs import check_available
        why = check_available()
        if why:
            _error(why)
            return 2
    if args.plot is not False:
        from .plots import check_available as plot_unavailable
        why = plot_unavailable()
        if why and args.plot:
            _error(why)
            return 2
        if why:
            _say(f"{PROG}: no curves.png: {why}")
        args.plot = not why
    try:
        factory = load_entry_point(args.task)
    except TaskError as e:
        _error(str(e))
        return 2
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "report.json")
    cfg = RunConfig(epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, val_steps=args.val_steps,
                    seed=args.seed, patience=args.patience, debug_forward=args.debug_forward,
                    progress=sys.stderr.isatty() if args.progress is None else args.progress)
    header = {"version": 1, "command": ["mixprec", "compare"] + list(args.argv), "task": args.task,
              "device": _device_name(device), "torch": torch.__version__, "mixprec": _version(),
              "modes_requested": [m.name for m in modes], "default_modes": default_modes(device),
              "settings": {k: getattr(args, k) for k in ("epochs", "steps_per_epoch", "val_steps", "tolerance",
                                                         "max_skipped", "patience", "seed", "debug_forward")}}
    _say(f"{PROG}: task {args.task} on {header['device']}, torch {torch.__version__}; "
         f"modes {', '.join(m.name for m in modes)}; {args.epochs} epoch(s) each")

    results, init_state, metric = [], {}, {"name": "metric", "higher": True}
    rec, exit_code, error = None, 0, None
    tb_run = None
    if args.tensorboard:
        from .tb_logs import new_run_dir
        tb_run = new_run_dir(os.path.join(args.out, "tensorboard"))
        header["tensorboard_run"] = tb_run

    def save(complete: bool) -> None:
        add_relative_figures(results)
        header.update(metric_name=metric["name"], higher_is_better=metric["higher"])
        write_json(json_path, header, results, rec, complete, error)

    try:
        try:
            warm_up(factory, args.task, device, cfg, init_state)
        except TaskError as e:
            error = str(e)
            _error(error)
            save(False)
            return 2
        for mode in modes:
            sink = None
            if tb_run is not None:
                from .tb_logs import TensorBoardSink
                sink = TensorBoardSink(tb_run, mode.name)
            try:
                r = run_mode(mode, factory, args.task, device, cfg, init_state, sink, metric_info=metric)
                results.append(r)
                if sink is not None:
                    add_relative_figures(results)  # the speed-up against O0, which ran first
                    sink.add_result(r, [m.name for m in modes])
            except TaskError as e:  # the task itself is malformed: every mode would fail the same way
                results.append(e.result)
                error = str(e)
                _error(error)
                save(False)
                return 2
            finally:
                if sink is not None:
                    sink.close()
            _say(_summary(r))
            save(False)
    except KeyboardInterrupt:
        error = "interrupted"
        _error("interrupted; figures measured so far are in " + json_path)
        save(False)
        return 130

    add_relative_figures(results)
    rec = recommend(results, args.tolerance, args.max_skipped, metric["higher"], metric["name"])
    memory = memory_comparable(results)
    rec.switch, rec.versus_torch = versus_torch(results, rec, args.tolerance, metric["higher"], metric["name"],
                                                memory)
    _say("")
    _say(table(results, metric["name"]))
    _say("")
    _say("s/epoch: training only, after the first (warm-up) epoch when there are several.")
    _say("peak MB: the CUDA allocator's peak." if memory else
         "peak memory: not shown on a CPU, where it measures the allocator more than the mode.")
    for line in state_lines(results):
        _say(line)
    for r in results:
        if r.fp8_linears:
            _say(f"{r.mode}: {r.fp8_linears} nn.Linear in FP8; {r.fp8_fallbacks} call(s) ran plain F.linear "
                 "(token count not a multiple of 16)")
        if r.note:
            _say(f"{r.mode}: {r.note}")
    _say(f"Every figure and curve: {json_path}")
    if rec.mode:
        _say(f"Recommended: {rec.mode}  ({rec.rule})")
    else:
        _say("No recommendation: " + rec.reasons.get(BASELINE, "no baseline"))
    for r in results:
        if r.mode != rec.mode:
            _say(f"  {r.mode}: {rec.reasons.get(r.mode, '')}")
    _say(f"Versus torch.amp: {rec.versus_torch}")
    base = results[0]
    ooms = [r for r in results if r.status == OOM]
    if base.status != OK:
        error, exit_code = f"{BASELINE} (the baseline) {base.status}: {base.error}", 1
    elif ooms:
        error, exit_code = f"{ooms[0].mode} ran out of memory: {ooms[0].error}", 1
    if args.plot:
        try:
            from .plots import plot_curves
            plot_curves(os.path.join(args.out, "curves.png"), results, metric["name"], args.tolerance, metric["higher"])
        except Exception as e:  # a plotting problem must not lose the measurements
            _error(f"could not write curves.png: {e}")
            exit_code = exit_code or 1
    save(True)
    outputs = [json_path] + ([os.path.join(args.out, "curves.png")] if args.plot else []) + \
        ([tb_run + os.sep] if tb_run else [])
    _say(f"Wrote {', '.join(outputs)}")
    if error:
        _error(error)
    return exit_code


def _version() -> str:
    from .. import __version__
    return __version__


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed as one line
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "env":
        from .env import collect, render
        print(render(collect()), flush=True)
        return 0
    args.argv = argv[1:]
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
