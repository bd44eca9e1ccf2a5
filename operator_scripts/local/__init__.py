"""`ddp-ops local`: a rendered job's pods run on this machine as the controllers and the
kubelet would run them."""
