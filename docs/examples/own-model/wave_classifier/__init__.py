"""An example of your own model and data as trainer plug-ins: noisy sine waves of four
frequencies (`wave_classifier.data:build_dataset`) and a small 1-D convolutional classifier
for them (`wave_classifier.model:build_model`). README, "Your own model and data"."""
