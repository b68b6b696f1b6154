"""The comparison harness behind `fxbudget compare` and `fxbudget report`: tasks and prompts (`tasks`), the grid
runner (`runner`), the shared prefill branched per rule (`branch`), result files (`results`), reports (`report`) and
the allocator setting (`malloc`)."""
