"""What a checkpoint is, read without the models: finding it and its ``config.json``
(``hub``), and the registry of model families (``families``)."""
