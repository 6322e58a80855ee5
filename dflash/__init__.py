"""DFlash drafter trainer: data, frozen target capture, drafter model, loss, checkpoint, decoding."""
