//! Makes sure the task's directory is there before each start.

use super::{TaskHook, TaskHookContext};
use crate::error::HookError;

/// Makes `<alloc_dir>/<task>/{local,secrets,tmp}` (idempotent; the alloc
/// dir hook made them already unless something removed them since) and
/// the shared log directory, and the task's node data dir.
pub struct TaskDirHook;

#[async_trait::async_trait]
impl TaskHook for TaskDirHook {
    fn name(&self) -> &'static str {
        "task_dir"
    }

    async fn prestart(&mut self, ctx: &mut TaskHookContext) -> Result<(), HookError> {
        ctx.alloc_dir.build_shared()?;
        ctx.alloc_dir.build_task(&ctx.task.name)?;
        ctx.alloc_dir
            .build_node_data(&ctx.alloc.job_id, &ctx.alloc.task_group, &ctx.task.name)?;
        Ok(())
    }
}
