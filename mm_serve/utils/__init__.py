"""Process-wide helpers that import nothing else of mm_serve: the
torchvision workaround (``_compat``), host-to-device copies (``transfer``), the torch
profiler (``profiler``), the cache folder (``cache_dir``)."""
