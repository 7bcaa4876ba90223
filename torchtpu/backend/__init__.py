"""The tpu device: tensor type, dispatcher, op table, device module."""
