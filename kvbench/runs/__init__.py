"""Running a configuration: the Hydra entry, validation, the grid launcher's sample-major loop,
sharding and merging, the run directory, failure records and cost accounting."""
