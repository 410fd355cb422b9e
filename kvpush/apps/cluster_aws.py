"""The AWS access of `kvpush cluster`: the only functions that talk to the API; botocore's errors become
ClusterError here, each a line that says what to do."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ClusterError(Exception):
    """A condition the user must fix before the command can run; the message is the whole story."""


def aws_session(region: str | None, profile: str | None) -> Any:
    import boto3
    import botocore.exceptions

    try:
        session = boto3.Session(profile_name=profile)
    except botocore.exceptions.ProfileNotFound as exc:
        raise ClusterError(f"AWS profile {profile!r} not found in your AWS config files") from exc
    region = region or session.region_name
    if not region:
        raise ClusterError("no AWS region: pass --region (the stack's `region` variable) or set AWS_REGION")
    known = (
        set(session.get_available_regions("ec2"))
        | set(session.get_available_regions("ec2", partition_name="aws-us-gov"))
        | set(session.get_available_regions("ec2", partition_name="aws-cn"))
    )
    if region not in known:
        raise ClusterError(f"unknown AWS region {region!r}: pass a Region name such as us-east-2, not an AZ")
    if session.get_credentials() is None:
        raise ClusterError(
            "no AWS credentials found: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "or run on a cluster node (its instance role can describe the cluster)"
        )
    return boto3.Session(profile_name=profile, region_name=region)


def _translate(exc: Exception, region: str) -> ClusterError:
    import botocore.exceptions

    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)):
        return ClusterError(
            "no usable AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(exc, botocore.exceptions.EndpointConnectionError):
        return ClusterError(
            f"cannot reach the EC2 endpoint of region {region!r}: check the region and your network"
        )
    if isinstance(exc, botocore.exceptions.ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        message = exc.response.get("Error", {}).get("Message", str(exc))
        if code in ("AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId", "ExpiredToken"):
            return ClusterError(f"AWS rejected the credentials ({code}): refresh them (e.g. `aws sso login`)")
        if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException"):
            return ClusterError(f"not allowed: {message}")
        if code == "NoSuchBucket":
            return ClusterError(f"S3 bucket does not exist: {message}")
        return ClusterError(f"AWS error {code}: {message}")
    return ClusterError(str(exc))


def aws_call(region: str, fn: Any, **kwargs: Any) -> Any:
    import boto3.exceptions
    import botocore.exceptions

    try:
        return fn(**kwargs)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise _translate(exc, region) from exc
    except boto3.exceptions.S3UploadFailedError as exc:
        # upload_file wraps the ClientError; its text already names the bucket and the reason.
        raise ClusterError(f"S3 upload failed: {exc}") from exc


def aws_pages(region: str, client: Any, operation: str, **kwargs: Any) -> Iterable[dict[str, Any]]:
    import botocore.exceptions

    try:
        yield from client.get_paginator(operation).paginate(**kwargs)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise _translate(exc, region) from exc
