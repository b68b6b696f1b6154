"""The comparison harness behind `fxbudget compare`, `search` and `report`: the grid and its row keys (`grid`, no
torch), tasks and prompts (`tasks`, one module per task family), the grid runner (`runner`) and what it measures
(`measure`), the shared prefill branched per rule (`branch`), the answer likelihood (`likelihood`), result files
(`results`), reports (`report`, `plots`, `stats`), the rule search (`search`), Ray (`ray_runner`, `ray_options`) and
the allocator setting (`malloc`), and Ctrl-C deferred to the runner's safe points (`interrupt`).

May import every package below it: `api`, `fairness`, `compiler`, `cache`, `passes`, `kernel`, `rules`, `models`,
`checks`.
"""
