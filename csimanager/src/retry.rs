//! Retrying a fallible async call with backoff, telling each retry: the
//! one loop the CSI calls of csimanager and of the alloc runner's CSI hook
//! retry with.

use std::future::Future;
use std::time::Duration;

use backon::{BackoffBuilder, Retryable};

/// Runs `call` until it succeeds, fails with an error `retryable` refuses,
/// or `backoff` gives up; `notify` hears of each error that is retried and
/// how long until the next attempt. Sleeps on the tokio timer (so paused
/// test time drives it). Returns the last outcome.
pub async fn retry_notify<T, E, F, Fut, B>(
    backoff: B,
    call: F,
    retryable: impl FnMut(&E) -> bool,
    notify: impl FnMut(&E, Duration),
) -> Result<T, E>
where
    B: BackoffBuilder,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    call.retry(backoff)
        .sleep(tokio::time::sleep)
        .when(retryable)
        .notify(notify)
        .await
}
