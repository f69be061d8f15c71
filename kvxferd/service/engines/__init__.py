"""The daemon's engine registrations: the registry, slots, the memory engines hand over, holds placed."""
