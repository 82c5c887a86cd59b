"""What DIMR and the draft vocabulary are fitted on: prompts, the target's own continuations and log-probs,
and a stratified corpus of task families split into calibration, validation and held-out prompts."""
