"""Engine integrations: the thin engine-side halves that talk to kvxferd daemons."""
