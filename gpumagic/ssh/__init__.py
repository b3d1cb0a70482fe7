"""SSH: ssh_config and known_hosts resolution as OpenSSH does it, the connection, the sandbox sshd."""
