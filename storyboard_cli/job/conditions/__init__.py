"""job stage: the conditioning kinds, one module each."""
