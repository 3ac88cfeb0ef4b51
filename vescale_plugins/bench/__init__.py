"""The side-by-side benchmarks against FSDP2 (and the peers: Megatron-FSDP 1 and 2, DeepSpeed
ZeRO-3): ``python -m vescale_plugins.bench``.

* :mod:`.__main__`: the CLI; without a subcommand the comparison of :mod:`.compare` (``make bench``).
* The subcommands, one module each: ``step`` (:mod:`.step`), ``collectives``
  (:mod:`.gloo_collectives`), ``adam8bit``, ``muon``, ``init-memory`` (:mod:`.init_memory`) and
  ``scale`` (:mod:`.scale`, one world size at a time in :mod:`.scale_run`).
* What they share: the engines (:mod:`.engines`, :mod:`.megatron_engine` with its CPU stand-ins
  :mod:`.megatron_cpu`, :mod:`.deepspeed_engine`), the models
  (:mod:`.llama`, :mod:`.linear_stack`), launching ranks (:mod:`.runner`), figures and tables
  (:mod:`.report`), argument types (:mod:`.arguments`).
* :mod:`.forecast_accuracy`: the forecast's step-time ratio against the bench's measured one.
"""
