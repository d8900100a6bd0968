//! Makes the alloc directory and every task's directory.

use super::{AllocHook, AllocHookContext};
use crate::error::HookError;

/// Makes `<alloc_dir>/alloc/{data,logs,tmp}` and each task's
/// `{local,secrets,tmp}`. The directory is removed when the alloc is
/// destroyed, not at postrun: logs outlive the tasks.
pub struct AllocDirHook;

#[async_trait::async_trait]
impl AllocHook for AllocDirHook {
    fn name(&self) -> &'static str {
        "alloc_dir"
    }

    async fn prerun(&mut self, ctx: &AllocHookContext) -> Result<(), HookError> {
        ctx.alloc_dir.build_shared()?;
        let group = ctx.alloc.group().ok_or_else(|| {
            HookError::Invalid(format!(
                "group {:?} is not in the job",
                ctx.alloc.task_group
            ))
        })?;
        for task in &group.tasks {
            ctx.alloc_dir.build_task(&task.name)?;
        }
        Ok(())
    }

    async fn postrun(&mut self, _ctx: &AllocHookContext) -> Result<(), HookError> {
        Ok(())
    }
}
