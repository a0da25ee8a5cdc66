"""The front end, in the API server's (or the offline script's) process: prompts in, outputs
out.

Input processing (``processor``: chat template, tokenization, validation; ``mm_processor``:
image hashing, the processor cache, placeholder expansion), the engine core client
(``core_client``, over ZeroMQ with the ``mm_serve.messages`` structs), output processing
(``output_processor``, ``detokenizer``), what ``LLM`` and ``AsyncLLM`` share (``base``), and
``AsyncLLM``, which ties them to an event loop. Nothing here imports the scheduler, the model
runner or the models: they live in the engine core process (``mm_serve.engine``).
"""
