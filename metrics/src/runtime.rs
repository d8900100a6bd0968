//! The tokio runtime's own numbers, read when scraped: how many tasks are
//! alive. A count that does not grow with the objects the process holds
//! (volumes, say) shows that it keeps no task per object.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug)]
pub(crate) struct RuntimeCollector;

impl Collector for RuntimeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // Scraped outside a runtime (a test, a tool): nothing to report.
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return Ok(());
        };
        let alive = handle.metrics().num_alive_tasks();
        let g = ConstGauge::new(i64::try_from(alive).unwrap_or(i64::MAX));
        let m = encoder.encode_descriptor(
            "runtime_alive_tasks",
            "Tasks alive on the process's tokio runtime",
            None,
            g.metric_type(),
        )?;
        g.encode(m)
    }
}
