"""The control plane's side of the data-plane workers: starting them clean, watching them, restarting them."""
