"""gunicorn's configuration for wsgi_host.py: each worker starts its replica when it is
ready and stops it when it exits (with or without preload_app, as the recipe does)."""

# A newer gunicorn's control socket, one path per user by default, would be shared
# by the two servers of the test (an older gunicorn ignores the setting).
control_socket_disable = True


def post_worker_init(worker):
    from wsgi_host import replica

    replica.start()


def worker_exit(server, worker):
    from wsgi_host import replica

    replica.stop()
