"""What comes from outside, checked at the edge: a user's files and values (JSON, WAV, images,
.npy), token ids, chat templates, code in a model directory, pickles."""
