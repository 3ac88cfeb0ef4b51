"""The parts of the device check (:mod:`vescale_plugins.tools.gpu_check`), one module per subject.

Each part is a function ``run(ctx: PartContext) -> dict`` named in the check's plan as
``"module:function"``; the check runs it in a process of its own under its own time budget
(a CUDA error is sticky for a process, so a failing part cannot poison the next) and keeps
what it returns as that part's JSON. A part returns ``{"status": "skipped", "reason": ...}``
when its subject is absent; a raised exception is a failure. A module the plan names that
does not exist yet is a skipped part, which is how features still being built get a place.
"""
