"""The preprocessing workers: processes that decode, check and preprocess images for the front
end (``pool.PreprocessPool``), so that the front end's thread never holds the GIL for it."""
