"""Where a test's exports are stored, as the test sees it: local files (the default) or a bucket
on the real S3 server scripts/test starts (moto's, over HTTP on loopback). Chosen per test with
the `export_store` fixture; workers get `store.env` to publish to the same place."""
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import boto3

from config.settings import s3_exports_storage

S3_ENDPOINT_ENV = "FAIRSHARE_TEST_S3_ENDPOINT_URL"
S3_REGION = "us-east-1"
# moto accepts any credentials; these reach boto3 the standard way (the environment).
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "fairshare-test", "AWS_SECRET_ACCESS_KEY": "fairshare-test"}


@dataclass
class LocalStore:
    root: Path
    name: str = "local"
    env: dict[str, str] = field(default_factory=dict)

    def files(self) -> list[str]:
        """Every stored object, as sorted keys."""
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def ids(self, keys: list[str]) -> dict[str, object]:
        """(inode, mtime ns) of each file: unchanged means nobody wrote it again."""
        return {k: ((self.root / k).stat().st_ino, (self.root / k).stat().st_mtime_ns) for k in keys}


class S3Store:
    """A fresh versioned bucket: every write makes a new version, so `ids` tells a rewrite apart."""

    name = "s3"

    def __init__(self, endpoint: str):
        self.bucket = f"fairshare-test-{uuid.uuid4().hex[:12]}"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name=S3_REGION,
                                   aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                   aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        self.client.create_bucket(Bucket=self.bucket)
        self.client.put_bucket_versioning(Bucket=self.bucket, VersioningConfiguration={"Status": "Enabled"})
        self.env = {"FAIRSHARE_EXPORTS_S3_BUCKET": self.bucket, "FAIRSHARE_EXPORTS_S3_ENDPOINT_URL": endpoint,
                    "FAIRSHARE_EXPORTS_S3_REGION": S3_REGION, **S3_CREDENTIALS}
        self.storage = s3_exports_storage(bucket=self.bucket, endpoint_url=endpoint, region=S3_REGION)

    def files(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=self.bucket)
        return sorted(item["Key"] for item in listed.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def ids(self, keys: list[str]) -> dict[str, object]:
        """Each object's version: unchanged means nobody wrote it again."""
        return {k: self.client.head_object(Bucket=self.bucket, Key=k)["VersionId"] for k in keys}

    def versions(self, key: str) -> int:
        """How many times `key` was written."""
        listed = self.client.list_object_versions(Bucket=self.bucket, Prefix=key)
        return sum(1 for v in listed.get("Versions", []) if v["Key"] == key)


def s3_endpoint() -> str | None:
    return os.environ.get(S3_ENDPOINT_ENV)
