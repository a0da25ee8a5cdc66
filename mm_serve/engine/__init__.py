"""The engine core process: ``core_proc`` (sockets, threads, busy loop) around ``core.EngineCore``
(the scheduler of ``mm_serve.sched`` and the model runner of ``mm_serve.worker``, one step at a
time). The offline ``LLM`` may run ``EngineCore`` in its own process instead."""
