"""What the API server and the engine core share: ``SamplingParams`` (``sampling_params``,
``structured_outputs``), the engine ``Request`` (``request``), what the engine produces
(``outputs``), the engine's counters (``stats``), and the ZeroMQ messages between the two
processes (``wire``)."""
