"""The compile path from `fxbudget.compile` to the rewritten graph: the forward it installs (`forward`), the call
positions and shape buckets (`positions`, `buckets`), the regions handed to Dynamo (`regions`) and the `fxbudget`
Dynamo backend that runs the SDPA pass (`backend`).

May import: `cache`, `passes`, `kernel`, `rules`, `models`, `checks`.
"""
