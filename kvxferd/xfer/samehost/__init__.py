"""Same-host reads (issue #37): a remote rank's memory opened here and copied by this process, not NIXL."""
