"""Training of the embedded tool model (not in the wheel): the generated corpus (`tool_corpus`)
and the recipe (`train_tool_model`); run from the repository root."""
