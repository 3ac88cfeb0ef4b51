"""Run an unchanged training script with veScale-FSDP: the program ``accelerate launch`` starts.

    accelerate launch --config_file fsdp2.yaml -m accelerate_plugin.run train.py --lr 1e-4
    accelerate launch --config_file fsdp2.yaml -m accelerate_plugin.run -m my_pkg.train

Accelerate's config file cannot carry a new option (unknown keys are rejected or dropped
before the child processes start) and Accelerate reads no plugin from anywhere, so the
switch happens in each child process instead: this module sets ``ACCELERATE_USE_VESCALE_FSDP``
(and ``ACCELERATE_USE_CPU`` on a machine without GPUs), makes sure the hooks are installed,
then runs the script as ``__main__`` exactly as ``python train.py`` / ``python -m
my_pkg.train`` would. Every ``Accelerator`` the script creates, including the one
``transformers.Trainer`` creates, then uses veScale-FSDP with the settings of the FSDP2 config.
"""

from __future__ import annotations

import os
import runpy
import sys

from .hooks import USE_VESCALE_ENV, has_collective_device, install

USAGE = "usage: python -m accelerate_plugin.run (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    """Run ``SCRIPT`` (or ``-m MODULE``) with ``ARGS`` as its ``sys.argv``, veScale-FSDP switched on."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_module = bool(argv) and argv[0] in ("-m", "--module")
    if as_module:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    os.environ[USE_VESCALE_ENV] = "1"
    if not has_collective_device():
        # Accelerate (and transformers' TrainingArguments, which sets Accelerate's state up
        # before any Accelerator exists) only run several CPU processes when told so.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    install()
    target = argv[0]
    sys.argv = argv
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # ``python train.py`` puts the script's directory first on the path; so do we.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
