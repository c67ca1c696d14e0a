"""kvbench's grid launcher for Hydra (`hydra/launcher=grid`), found through the `hydra_plugins` namespace package."""
