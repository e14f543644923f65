"""A real S3-protocol server on loopback for the remote-warehouse tests: moto's server mode
in a thread of the test process, on 127.0.0.1 and a port the kernel picks, with dummy
credentials. `S3Server.env()` and `S3Server.fsspec_conf()` point every AWS client of the
process at it, so no real AWS endpoint, credential file or config file is ever read."""

from __future__ import annotations

import logging
from typing import Any

from moto.server import ThreadedMotoServer

KEY = "cmroot-test-key"
SECRET = "cmroot-test-secret"
REGION = "us-east-1"


class S3Server:
    """moto's S3 server on 127.0.0.1: start() once, stop() at the end."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    def start(self) -> S3Server:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request else
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def env(self) -> dict[str, str]:
        """Environment for botocore: dummy credentials, no config or credential file, and
        the server as the endpoint of any client fsspec's config does not reach."""
        return {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def fsspec_conf(self) -> dict[str, Any]:
        """s3fs options for fsspec's global config: the only way to point the store's
        `s3://` warehouse roots at an endpoint (a root is a bare URL, with no options).
        The region comes from AWS_DEFAULT_REGION: given here, s3fs would send it as the
        LocationConstraint of a new bucket, which S3 refuses for us-east-1."""
        return {
            "endpoint_url": self.endpoint,
            "key": KEY,
            "secret": SECRET,
            "anon": False,
        }

    def client(self) -> Any:
        """An s3fs client of its own (not the store's cached instance) and without a
        listing cache: another writer, as a job on another host would be, and one whose
        answers are what the server holds now."""
        import s3fs

        return s3fs.S3FileSystem(
            skip_instance_cache=True, use_listings_cache=False, **self.fsspec_conf()
        )
