"""The run stage: a render, from the job's batches to the finished folder, on one GPU or several."""
