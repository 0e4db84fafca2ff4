"""Pure analyzers: a window of frames in, findings out."""
